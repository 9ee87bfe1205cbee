"""Static facts about a running engine (the Info RPC and the offline API's limits)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str
    max_model_len: int
    block_size: int
    num_blocks: int
    vocab_size: int
    attention_backend: str
    dtype: str
    engine_id: str
    eos_token_ids: tuple[int, ...] = ()
    max_loras: int = 0
    """Most distinct LoRA adapters in one step (0: this engine serves no adapters)."""
    max_lora_rank: int = 0
    """Largest adapter rank it accepts."""

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size
