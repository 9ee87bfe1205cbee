"""How many KV blocks the pool gets, and the capacity that buys.

CPU: a configured space in GiB. GPU: after a profiling forward pass at the
largest batch, what is left of memory_utilization x device memory.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

logger = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class KVCapacity:
    num_blocks: int
    block_size: int
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks_per_max_len_sequence(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def max_concurrency(self) -> float:
        """Sequences of max_model_len tokens that fit at once."""
        return self.num_blocks / self.blocks_per_max_len_sequence


def num_blocks_for_cpu(kv_cache_gib: float, bytes_per_block: int) -> int:
    return int(kv_cache_gib * GIB) // bytes_per_block


def num_blocks_for_gpu(*, total_bytes: int, memory_utilization: float, peak_torch_bytes: int,
                       non_torch_bytes: int, bytes_per_block: int) -> int:
    """Blocks from the budget left after weights + peak activations (peak_torch_bytes,
    measured in a profiling pass) and memory outside torch's allocator (CUDA context,
    other processes' use counts against us too)."""
    budget = total_bytes * memory_utilization - peak_torch_bytes - non_torch_bytes
    return max(0, int(budget) // bytes_per_block)


def check_capacity(capacity: KVCapacity, *, device_is_cuda: bool) -> None:
    """Refuse to start unless one max_model_len sequence fits, naming what to change."""
    if capacity.num_blocks >= capacity.blocks_per_max_len_sequence:
        return
    setting = "memory_utilization" if device_is_cuda else "kv_cache_gib"
    raise ValueError(
        f"the KV pool holds {capacity.num_tokens} tokens ({capacity.num_blocks} blocks), less "
        f"than one sequence of max_model_len={capacity.max_model_len}; raise {setting} "
        f"or lower max_model_len")


def log_capacity(capacity: KVCapacity, bytes_per_block: int, dtype_name: str) -> None:
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s); max concurrency at "
        "max_model_len=%d: %.2fx", capacity.num_blocks, capacity.block_size,
        capacity.num_tokens, capacity.num_blocks * bytes_per_block / GIB,
        dtype_name, capacity.max_model_len, capacity.max_concurrency)
