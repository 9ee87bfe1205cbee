"""The gateway's settings: every field is an environment variable CONVEYOR_GATEWAY_<NAME>.

One class holds them all: the gateway's own fields here, tenancy's (Redis, API
keys, tiers, quotas, timelines), routing's (session affinity, prefix hints,
overload bounds), the batch API's and LoRA adapters' by inheritance, all under the
same prefix.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from conveyor.common.settings import ServiceSettings
from conveyor.gateway.batches.settings import BatchApiSettings
from conveyor.gateway.lora.settings import LoraSettings
from conveyor.gateway.routing.settings import RoutingSettings
from conveyor.gateway.tenancy.settings import TenancySettings


class GatewaySettings(ServiceSettings, TenancySettings, RoutingSettings, BatchApiSettings,
                      LoraSettings):
    """Settings of the gateway process."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_GATEWAY_", extra="ignore")

    port: int = Field(8000, description="HTTP port to listen on (0 picks a free one).")
    tokenizer_address: str = Field(
        "127.0.0.1:50051", description="Comma-separated host:port list of tokenizer replicas, "
        "used only while none has registered in Redis."
    )
    engine_addresses: str = Field(
        "127.0.0.1:50052", description="Comma-separated host:port list of engine replicas, "
        "used only while no engine has registered in Redis (single-engine and local setups)."
    )
    detok_address: str = Field(
        "127.0.0.1:50053", description="Comma-separated host:port list of detok replicas, "
        "used only while none has registered in Redis."
    )
    replica_refresh_s: float = Field(
        1.0, gt=0, description="Seconds between reads of the tokenizer and detok replicas "
        "registered in Redis (a new replica gets calls within this)."
    )
    replica_max_attempts: int = Field(
        3, ge=1, description="Replicas one tokenizer call or detok stream tries before it fails "
        "(a replica that does not answer is replaced by another)."
    )
    keepalive_time_s: float = Field(
        2.0, ge=1.0, description="Seconds between keepalive pings on tokenizer, detok and "
        "engine channels (servers accept one a second at most)."
    )
    keepalive_timeout_s: float = Field(
        2.0, gt=0, description="Seconds a keepalive ping may go unanswered before the peer is "
        "dropped (its calls fail over to another replica, its streams move)."
    )
    served_model_name: str | None = Field(
        None, description="Model name clients use (default: the name the tokenizer serves)."
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Longest a request may take, streaming included, in seconds."
    )
    rpc_timeout_s: float = Field(
        10.0, gt=0, description="Deadline of one unary gRPC call (render, stats, decode)."
    )
    retry_after_s: int = Field(
        1, ge=0, description="Retry-After seconds sent with 503 when no engine can take a request."
    )
    engine_stats_max_age_s: float = Field(
        0.25, ge=0, description="How long engine loads (Stats) are reused to pick an engine."
    )
    max_n: int = Field(16, ge=1, description="Largest n (choices per prompt) a request may use.")
    tool_call_parser: Literal["hermes", "llama3_json"] = Field(
        "hermes", description="How the model writes the tool calls that tool_choice auto reads "
        "back: hermes (<tool_call> JSON blocks; a chat template without tool support, like the "
        "bundled model's, is given the tools in this form) or llama3_json."
    )
    responses_ttl_s: float = Field(
        86400.0, gt=0, description="Seconds a stored response (the Responses API's store, on by "
        "default) and its conversation are kept for GET /v1/responses/{id} and "
        "previous_response_id; a stored chat completion (store: true) this long after it ended."
    )
    conversations_ttl_s: float = Field(
        30 * 86400.0, gt=0, description="Seconds a conversation (the Conversations API) is "
        "kept after its last change (created, items added or deleted, metadata changed)."
    )
    responses_lease_s: float = Field(
        10.0, gt=0, description="Seconds a background response's run stays leased to the "
        "gateway replica generating it (renewed every tenth of it); a replica that dies "
        "leaves its responses failed once their leases run out."
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1, description="Largest request body in bytes; a larger one gets 413 "
        "before it is read."
    )

    @property
    def engine_address_list(self) -> list[str]:
        """engine_addresses split on commas, blanks dropped."""
        return [a.strip() for a in self.engine_addresses.split(",") if a.strip()]
