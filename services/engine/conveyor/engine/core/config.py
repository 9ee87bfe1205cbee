"""Scheduler and KV-cache settings, checked once when the engine starts."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.engine.core.errors import InvalidSchedulerConfig, KVCacheTooSmall


@dataclass(slots=True)
class SchedulerConfig:
    """How much work one step may hold and how the KV cache is cut into blocks.

    `num_blocks` comes from memory profiling at start (what is left of
    memory_utilization x device memory, divided by the bytes of one block).
    """

    num_blocks: int
    """KV blocks in the pool."""
    block_size: int = 16
    """Tokens per KV block."""
    max_model_len: int = 2048
    """Most tokens (prompt + output) one request may reach."""
    max_num_seqs: int = 256
    """Most requests running at once (in one step's batch)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step, shared by prefill chunks and decode tokens."""
    long_prefill_token_threshold: int | None = None
    """Most prompt tokens one request may take in a step (None: up to the budget), so a long
    prompt cannot crowd out other requests' prefills."""
    enable_prefix_caching: bool = True
    """Share full blocks between requests whose token prefixes (and cache salts) match."""
    max_num_waiting_seqs: int | None = None
    """Most requests in the waiting queue (None: no limit); see WaitingBounds."""
    max_num_waiting_tokens: int | None = None
    """Most tokens the waiting requests may still have to compute (None: no limit); at
    least max_model_len, so one request always fits an empty queue."""
    num_speculative_tokens: int = 0
    """Most draft tokens a decoding request is verified with per step (0: no speculation);
    see conveyor.engine.spec."""
    speculative_method: str = "ngram"
    """Who proposes drafts: "ngram" (the scheduler, by prompt lookup) or "draft" (a draft
    model in the runner, in the slots the scheduler leaves)."""
    ngram_min: int = 2
    ngram_max: int = 4
    """The n-gram lengths the prompt-lookup proposer matches, longest first."""
    speculative_max_running: int = 4
    """Speculate only while at most this many requests run: a larger batch already reads
    each weight once for many tokens, and draft rows would only add compute."""
    max_loras: int = 0
    """Most distinct LoRA adapters among the running requests (the runner's slots); 0: no
    adapters."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def validate(self) -> None:
        """Raise naming the setting to change when a value is out of range or the pool
        cannot hold one max_model_len sequence."""
        for name in ("num_blocks", "block_size", "max_model_len", "max_num_seqs",
                     "max_num_batched_tokens"):
            value = getattr(self, name)
            if value < 1:
                raise InvalidSchedulerConfig(f"{name} must be at least 1, got {value}")
        for name in ("num_speculative_tokens", "speculative_max_running", "max_loras"):
            value = getattr(self, name)
            if value < 0:
                raise InvalidSchedulerConfig(f"{name} must be at least 0, got {value}")
        if self.speculative_method not in ("ngram", "draft"):
            raise InvalidSchedulerConfig(f"speculative_method must be ngram or draft, got "
                                         f"{self.speculative_method!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidSchedulerConfig(f"need 1 <= ngram_min ({self.ngram_min}) <= ngram_max "
                                         f"({self.ngram_max})")
        for name in ("long_prefill_token_threshold", "max_num_waiting_seqs",
                     "max_num_waiting_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidSchedulerConfig(f"{name} must be None or at least 1, got {value}")
        self._validate_waiting_tokens()
        if self.max_blocks_per_seq > self.num_blocks:
            raise KVCacheTooSmall(
                f"the KV cache holds {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.kv_capacity_tokens} tokens, fewer than one max_model_len="
                f"{self.max_model_len} sequence needs ({self.max_blocks_per_seq} blocks); "
                f"increase kv_cache_gib (CPU), memory_utilization (GPU) or num_kv_blocks, "
                f"or lower max_model_len"
            )

    def _validate_waiting_tokens(self) -> None:
        bound = self.max_num_waiting_tokens
        if bound is not None and bound < self.max_model_len:
            raise InvalidSchedulerConfig(
                f"max_num_waiting_tokens ({bound}) must be at least max_model_len "
                f"({self.max_model_len}), or a long prompt could never be queued; raise "
                f"CONVEYOR_ENGINE_MAX_NUM_WAITING_TOKENS (0: no limit)"
            )
