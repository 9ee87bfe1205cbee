"""The detokenizer service's settings, from CONVEYOR_DETOK_* environment variables."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from conveyor.common.registration_settings import RegistrationSettings
from conveyor.common.settings import ModelSettingsMixin, ServiceSettings

DEFAULT_PORT = 50053


class DetokSettings(ModelSettingsMixin, RegistrationSettings, ServiceSettings):
    """Everything the detokenizer reads at start (e.g. CONVEYOR_DETOK_PORT)."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_DETOK_", extra="ignore")

    port: int = Field(DEFAULT_PORT, description="Port to listen on (0 picks a free one).")
