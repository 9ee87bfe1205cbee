"""Settings of the Files and Batches APIs: CONVEYOR_GATEWAY_<NAME> (GatewaySettings
inherits them). The batch token itself is tenancy's (batch_token)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

MAX_UPLOAD_BYTES = 200 * 1024 * 1024
"""OpenAI's limit of one uploaded batch input file (200 MB)."""


class BatchApiSettings(BaseSettings):
    """Where files are kept and how batches reach the workers."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_GATEWAY_", extra="ignore")

    files_dir: str = Field("~/.local/share/conveyor/files", description="Folder of uploaded "
                           "and batch output files, shared with the batch workers "
                           "(CONVEYOR_BATCH_FILES_DIR).")
    max_upload_bytes: int = Field(MAX_UPLOAD_BYTES, gt=0, description="Largest file POST "
                                  "/v1/files takes, streamed to disk (its own limit, not "
                                  "max_body_bytes).")
    batch_broker_url: str | None = Field(None, description="Celery broker (Redis) the batch "
                                         "workers read; default: redis_url.")
