"""The engine's load at one moment, for Stats, routing and Prometheus gauges."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot taken after a step; counters are totals since start."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_tokens: int = 0
    """Tokens the scheduler's waiting requests still have to compute."""
    max_num_waiting_seqs: int = 0
    """The waiting-queue bounds (0: no limit); past them arrivals are shed."""
    max_num_waiting_tokens: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache."""
    prefix_cache_hits: int = 0
    """Of those, tokens found."""
    num_preemptions: int = 0
    num_requests_shed: int = 0
    """Requests refused or pushed out because the waiting queue was full."""
    lora_adapters: tuple[str, ...] = ()
    """LoRA adapters held in memory (requests naming them start without reading files)."""
    running_lora_adapters: tuple[str, ...] = ()
    """Adapters of the running requests."""
    waiting_lora_adapters: tuple[str, ...] = ()
    """Adapters of the waiting requests."""

    @property
    def kv_usage(self) -> float:
        if not self.num_blocks:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries
