"""A snapshot of the scheduler's gauges and counters, for metrics and logs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class SchedulerStats:
    """Gauges (now) and counters (since start); derived rates are properties."""

    num_running: int
    num_waiting: int
    num_waiting_tokens: int
    """Tokens the waiting requests still have to compute."""
    kv_cache_usage: float
    """Fraction of KV blocks held by requests."""
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    num_preemptions: int
    num_evictions: int
    """Cached blocks dropped because their block was reused."""
    num_requests_shed: int = 0
    """Requests refused or pushed out because the waiting queue was full."""

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / max(self.num_prefix_query_tokens, 1)
