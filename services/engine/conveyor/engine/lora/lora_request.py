"""An adapter named by a caller of the offline API, as vLLM's LoRARequest."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """Run with the PEFT adapter in folder `lora_path`, known as `lora_name`."""

    lora_name: str
    lora_path: str
