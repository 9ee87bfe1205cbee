"""Settings read from environment variables, one prefix per service.

Each service subclasses `ServiceSettings` with its own prefix, e.g.
`CONVEYOR_TOKENIZER_PORT` for `TokenizerSettings.port`. Every field has a
one-line description, which `describe()` prints for the README's table.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "smollm2-135m-instruct"


class ServiceSettings(BaseSettings):
    """Fields every service has. Subclasses set `model_config`'s env_prefix."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", extra="ignore")

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(0, description="Port to listen on (0 picks a free one).")
    log_level: str = Field("INFO", description="Python logging level.")
    log_json: bool = Field(False, description="Log one JSON object per line instead of text.")
    drain_timeout_s: float = Field(
        10.0, description="On SIGTERM: seconds in-flight streams get to finish before exit."
    )

    @classmethod
    def describe(cls) -> list[tuple[str, str, str]]:
        """(environment variable, default, description) per field."""
        prefix = cls.model_config.get("env_prefix", "")
        return [
            (f"{prefix}{name.upper()}", repr(field.default), field.description or "")
            for name, field in cls.model_fields.items()
        ]


class ModelSettingsMixin(BaseSettings):
    """Fields of services that load the model or its tokenizer."""

    model: str = Field(
        DEFAULT_MODEL,
        description="Model name (smollm2-135m-instruct), a GGUF file or a local HF folder.",
    )
    served_model_name: str | None = Field(
        None, description="Name clients use for the model (default: the model setting)."
    )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
