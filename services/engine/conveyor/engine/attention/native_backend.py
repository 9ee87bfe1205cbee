"""Backend `native` (CPU): decode tokens through a C++ kernel that reads the paged pool
in place; prefill chunks through the torch backend's gather + SDPA.

The kernel (native/csrc/paged_decode_attention.cpp) walks each decode request's block
table straight from the pool with an online softmax, parallel over (kv head, request):
no context is copied into a workspace. On AVX-512 the requests of a thread whose tables
hold the same block at a column (a cached prefix) take it in one pass for all their query
heads (the cascade); on AVX2 they read it back to back while it is in cache. It takes fp32
pools and head sizes of native_kernel.HEAD_DIMS; the constructor refuses anything else,
naming the setting.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from conveyor.engine.attention.backend import AttentionSpec
from conveyor.engine.attention.metadata import AttentionMetadata
from conveyor.engine.attention.native_kernel import HEAD_DIMS, KERNEL_PATHS, load_decode_kernel
from conveyor.engine.attention.torch_backend import TorchAttentionBackend, store_kv
from conveyor.engine.attention.torch_plan import TorchAttentionPlan, build_plan

log = logging.getLogger("conveyor.engine.attention")


@dataclass(slots=True)
class NativeAttentionPlan:
    """One step: its slots, the decode rows for the kernel, the rest for torch."""

    slot_mapping: torch.Tensor
    decode_tokens: torch.Tensor | None
    """[Nd] flat index of the decode tokens, or None when every token decodes."""
    block_tables: torch.Tensor
    """[Nd, W] int32, contiguous: the decode rows' block tables."""
    seq_lens: torch.Tensor
    """[Nd] int64: the decode rows' context lengths."""
    prefill: TorchAttentionPlan | None
    """The prefill chunks' torch plan; None in a decode-only step."""


class NativeAttentionBackend:
    """Backend `native`: index_copy_ store, then the C++ decode kernel per layer (and the
    torch plan's SDPA for prefill chunks in the same step)."""

    name = "native"

    def __init__(self, spec: AttentionSpec, kernel_path: str = "auto") -> None:
        """kernel_path: a key of native_kernel.KERNEL_PATHS (auto: the best this CPU runs)."""
        if spec.head_dim not in HEAD_DIMS:
            raise ValueError(f"attention backend native supports head_dim {HEAD_DIMS}, the "
                             f"model has {spec.head_dim}; set attention_backend torch")
        self.spec = spec
        self._kernel = load_decode_kernel()
        self.use_kernel_path(kernel_path)
        self._torch = TorchAttentionBackend(spec)
        log.info("attention backend native: decode tokens through the C++ kernel %s (%s), "
                 "prefill chunks through torch SDPA", self._kernel.__file__, self.kernel_path)

    def use_kernel_path(self, kernel_path: str) -> None:
        """Decode through `kernel_path` from now on (a key of native_kernel.KERNEL_PATHS)."""
        if kernel_path not in KERNEL_PATHS:
            raise ValueError(f"kernel_path {kernel_path!r} is not one of {list(KERNEL_PATHS)}")
        if kernel_path == "auto":
            kernel_path = "avx512-cascade" if self._kernel.has_avx512() else "avx2"
        elif kernel_path == "avx512-cascade" and not self._kernel.has_avx512():
            raise ValueError(f"kernel_path {kernel_path} needs AVX-512, which this CPU lacks")
        self.kernel_path = kernel_path
        self._path = KERNEL_PATHS[kernel_path]

    def plan(self, meta: AttentionMetadata) -> NativeAttentionPlan:
        if meta.is_decode_only:
            return NativeAttentionPlan(meta.slot_mapping, None, meta.block_tables.contiguous(),
                                       meta.seq_lens.contiguous(), None)
        query_lens = meta.query_start_loc.diff()
        decode_rows = (query_lens == 1).nonzero().squeeze(1)
        return NativeAttentionPlan(
            slot_mapping=meta.slot_mapping,
            decode_tokens=meta.query_start_loc.index_select(0, decode_rows),
            block_tables=meta.block_tables.index_select(0, decode_rows),
            seq_lens=meta.seq_lens.index_select(0, decode_rows),
            prefill=build_plan(meta, self.spec.sliding_window, with_decode=False))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, plan: NativeAttentionPlan) -> torch.Tensor:
        if kv_cache.dtype != torch.float32:
            raise ValueError(f"attention backend native needs a float32 KV pool, got "
                             f"{kv_cache.dtype}; set dtype float32 or attention_backend torch")
        store_kv(key, value, kv_cache, plan.slot_mapping)
        if plan.prefill is None:
            return self._decode(query, kv_cache, plan)
        out = self._torch.attend(query, kv_cache, plan.prefill)
        if plan.decode_tokens.numel():
            decoded = self._decode(query.index_select(0, plan.decode_tokens), kv_cache, plan)
            out.index_copy_(0, plan.decode_tokens, decoded)
        return out

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
                plan: NativeAttentionPlan) -> torch.Tensor:
        query = query.contiguous()
        out = torch.empty_like(query)
        self._kernel.paged_decode_attention(out, query, kv_cache, plan.block_tables,
                                            plan.seq_lens, self.spec.scale,
                                            self.spec.sliding_window or 0, self._path)
        return out
