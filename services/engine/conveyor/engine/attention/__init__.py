"""Paged attention backends, chosen by name (`torch`, `triton`, `native`); see registry.py.

KV pool layout (one tensor per layer, owned by the model runner):
    kv_cache[layer] : [2, num_blocks, block_size, num_kv_heads, head_dim]
index 0 holds keys, 1 values; token slot s lives at block s // block_size,
offset s % block_size, i.e. row s of kv_cache[layer][0].view(-1, num_kv_heads, head_dim).
"""

from conveyor.engine.attention.backend import AttentionBackend, AttentionSpec
from conveyor.engine.attention.metadata import AttentionMetadata
from conveyor.engine.attention.registry import BACKEND_NAMES, create_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionSpec", "BACKEND_NAMES",
           "create_backend"]
