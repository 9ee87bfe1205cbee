"""Settings of routing across engine replicas: CONVEYOR_GATEWAY_<NAME>.

They share the gateway's prefix; the gateway's settings class can inherit from
this one to hold them all.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class RoutingSettings(BaseSettings):
    """Session affinity, prefix-cache hints and what counts as overloaded."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_GATEWAY_", extra="ignore")

    session_ttl_s: float = Field(1800.0, gt=0, description="How long a session stays bound to "
                                 "its engine after its last request.")
    prefix_hint_ttl_s: float = Field(300.0, gt=0, description="How long a prompt prefix stays "
                                     "hinted to the engine that last served it.")
    prefix_hint_blocks: int = Field(4, ge=0, description="Leading full blocks of a prompt that "
                                    "are hinted (0 turns prefix hints off); blocks are the "
                                    "engines' own (CONVEYOR_ENGINE_BLOCK_SIZE, which they "
                                    "publish).")
    max_waiting: int = Field(8, ge=0, description="An engine with more waiting requests is "
                             "busy: sessions and hints move off it when another engine is not "
                             "(an engine at its own CONVEYOR_ENGINE_MAX_NUM_WAITING_* bound is "
                             "full and is picked last).")
    max_stream_moves: int = Field(2, ge=0, description="Times one generation may move to "
                                  "another engine when its engine fails mid-stream (0: never; "
                                  "the client then gets an error event).")
    max_engine_attempts: int = Field(3, ge=1, description="Engines a request tries before any "
                                     "output when one is unreachable or its waiting queue is "
                                     "full; then 503 with Retry-After.")
    engine_list_max_age_s: float = Field(
        1.0, ge=0, description="How long a gateway routes with the engine registry's list "
        "before reading it again (one heartbeat interval; all requests share one read).")
    max_kv_usage: float = Field(0.95, gt=0, le=1, description="An engine using more of its KV "
                                "cache (0-1) is overloaded.")
    max_imbalance: int = Field(8, ge=0, description="A prefix hint is ignored when its engine "
                               "has this many more requests than the least loaded one.")
