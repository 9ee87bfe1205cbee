"""The tokenizer service's settings, from CONVEYOR_TOKENIZER_* environment variables."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from conveyor.common.registration_settings import RegistrationSettings
from conveyor.common.settings import ModelSettingsMixin, ServiceSettings

DEFAULT_PORT = 50051
DEFAULT_MAX_CHARS_PER_TOKEN = 16


class TokenizerSettings(ModelSettingsMixin, RegistrationSettings, ServiceSettings):
    """Everything the tokenizer reads at start (e.g. CONVEYOR_TOKENIZER_PORT)."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_TOKENIZER_", extra="ignore")

    port: int = Field(DEFAULT_PORT, description="Port to listen on (0 picks a free one).")
    num_workers: int = Field(
        4, ge=1, description="Threads that render and tokenize off the event loop."
    )
    max_chars_per_token: int = Field(
        DEFAULT_MAX_CHARS_PER_TOKEN, ge=1, description="Text longer than this many characters "
        "per token of the model's context length is refused (INVALID_ARGUMENT) before it is "
        "tokenized."
    )
    allow_request_chat_template: bool = Field(
        False, description="Render a request's own chat_template; Jinja's sandbox bounds "
        "range() but not time, so off (the default) refuses it with INVALID_ARGUMENT."
    )
