"""An adapter named by a caller of the offline API, as vLLM's LoRARequest."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """Run with the PEFT adapter in folder `lora_path`, known as `lora_name`. vLLM's
    signature: `lora_int_id` is its numeric id, kept so vLLM code runs unchanged; Conveyor
    knows an adapter by its name (and its files' contents), so it reads no meaning into it."""

    lora_name: str
    lora_int_id: int
    lora_path: str
