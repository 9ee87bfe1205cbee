"""Settings of LoRA adapters at the gateway: CONVEYOR_GATEWAY_<NAME>.

They share the gateway's prefix; the gateway's settings class inherits from this one.
"""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from conveyor.gateway.lora.catalog import check_adapter_name


class LoraSettings(BaseSettings):
    """The adapters every gateway starts with, and who may change them at run time."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_GATEWAY_", extra="ignore")

    lora_modules: str = Field(
        "", description="Comma-separated name=path LoRA adapters every tenant may use, path as "
        "the engines see it (vLLM's --lora-modules), e.g. sql=/adapters/sql,chat=/adapters/chat;"
        " added to the shared catalog the first time a gateway starts with them.")
    allow_runtime_lora_updating: bool = Field(
        False, description="With API keys off, let anyone call POST /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter (local use only; with keys on, an admin's key is needed).")
    lora_catalog_max_age_s: float = Field(
        1.0, ge=0, description="How long a gateway uses its read of the LoRA catalog; an "
        "adapter unloaded through another gateway may be used here for this long.")

    @field_validator("lora_modules")
    @classmethod
    def _check_lora_modules(cls, value: str) -> str:
        lora_module_table(value)
        return value

    @property
    def lora_module_table(self) -> dict[str, str]:
        """lora_modules as {name: path}."""
        return lora_module_table(self.lora_modules)


def lora_module_table(value: str) -> dict[str, str]:
    """{name: path} of a `name=path,name=path` list; ValueError naming the setting."""
    table: dict[str, str] = {}
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        name, sep, path = (part.strip() for part in entry.partition("="))
        if not sep or not path:
            raise ValueError(f"CONVEYOR_GATEWAY_LORA_MODULES entry {entry!r} must be name=path")
        if name in table:
            raise ValueError(f"CONVEYOR_GATEWAY_LORA_MODULES names {name!r} twice")
        table[check_adapter_name(name)] = path
    return table
