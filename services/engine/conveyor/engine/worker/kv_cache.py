"""The paged KV pool: one tensor per layer.

Layout (what every attention backend reads):
    kv_caches[layer] : [2, num_blocks, block_size, num_kv_heads, head_dim]
[0] are keys and [1] values; slot s = block * block_size + offset. All layers
live in one allocation so the pool is freed and sized as a unit.
"""

from __future__ import annotations

import torch

from conveyor.engine.model.model_config import ModelConfig


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x block_size x bytes per element."""
    element = torch.empty((), dtype=dtype).element_size()
    return (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
            * block_size * element)


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """Zeroed pool; returns one [2, num_blocks, block_size, Hkv, D] view per layer."""
    pool = torch.zeros(config.num_hidden_layers, 2, num_blocks, block_size,
                       config.num_key_value_heads, config.head_dim, dtype=dtype, device=device)
    return list(pool.unbind(0))
