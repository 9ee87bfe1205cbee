"""The batch worker's settings: every field is an environment variable CONVEYOR_BATCH_<NAME>."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from conveyor.common.settings import ServiceSettings

DEFAULT_FILES_DIR = "~/.local/share/conveyor/files"


class BatchSettings(ServiceSettings):
    """Settings of the batch worker (and of `python -m conveyor.batch status|run`)."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_BATCH_", extra="ignore")

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding batches, "
                           "files and line results (the gateways' CONVEYOR_GATEWAY_REDIS_URL).")
    redis_prefix: str = Field("conveyor", description="Prefix of every Redis key; the same as "
                              "the gateways' CONVEYOR_GATEWAY_REDIS_PREFIX.")
    broker_url: str | None = Field(None, description="Celery broker (Redis) URL; default: "
                                   "redis_url. The gateways' CONVEYOR_GATEWAY_BATCH_BROKER_URL.")
    gateway_url: str = Field("http://127.0.0.1:8000", description="The gateway each line is "
                             "sent to (the same pipeline as interactive requests).")
    gateway_token: str = Field("", description="Internal token batch lines carry; the gateways' "
                               "CONVEYOR_GATEWAY_BATCH_TOKEN.")
    files_dir: str = Field(DEFAULT_FILES_DIR, description="Folder of uploaded and generated "
                           "files, shared with the gateways (CONVEYOR_GATEWAY_FILES_DIR).")
    lines_in_flight: int = Field(8, ge=1, description="Lines one worker sends to the gateway "
                                 "at once.")
    chunk_size: int = Field(32, ge=1, description="Lines per Celery task (chunk).")
    visibility_timeout_s: float = Field(
        900.0, gt=0, description="A task of a worker killed outright is delivered again this "
        "long after it was taken; a chunk stops taking lines at half of it and hands the rest "
        "on, so no live chunk is ever delivered twice.")
    poll_interval_s: float = Field(0.5, gt=0, description="How often a running chunk checks "
                                   "whether its batch was cancelled or expired.")
    max_backoff_s: float = Field(30.0, gt=0, description="Longest wait before a line refused "
                                 "with 503 (or a gateway not reachable) is sent again.")
    line_timeout_s: float = Field(600.0, gt=0, description="Longest one line's HTTP request "
                                  "may take.")
    api_key: str = Field("", description="API key of `status` and `run` (the tenant they act "
                         "as); default: OPENAI_API_KEY.")

    @property
    def broker(self) -> str:
        return self.broker_url or self.redis_url
