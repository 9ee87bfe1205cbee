"""Backend `native` (CPU): decode tokens and prefill chunks through C++ kernels that read
the paged pool in place.

The decode kernel (native/csrc/paged_decode_attention.cpp) walks each decode request's block
table straight from the pool with an online softmax, parallel over (kv head, request):
no context is copied into a workspace. On AVX-512 the requests of a thread whose tables
hold the same block at a column (a cached prefix) take it in one pass for all their query
heads (the cascade); on AVX2 they read it back to back while it is in cache.
The prefill kernel (native/csrc/paged_prefill_attention.cpp) is flash attention over the
same pool: tiles of 16 query positions times a kv head's query heads, causal over the
request's whole context (a cached prefix and earlier chunks read in place, not gathered).
Both read fp32, bf16 or fp16 pools (bf16: a bf16 model's; fp16: kv_cache_dtype float16; 16-bit
elements widened to fp32 as they are read), with fp32 or bf16 queries (the model's dtype: fp32 over
an fp32 or fp16 pool, bf16 over a bf16 or fp16 one), and head sizes of native_kernel.HEAD_DIMS;
anything else is refused, naming the setting. All their arithmetic is fp32.
Prefill chunks of a bf16 model on a CPU with AMX go through the torch backend's gather + SDPA
instead (torch's bf16 SDPA runs on AMX tiles, faster than the kernel's fp32 arithmetic);
CONVEYOR_PREFILL_ATTENTION forces either way (A/B).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from conveyor.engine.attention.backend import AttentionSpec
from conveyor.engine.attention.metadata import AttentionMetadata
from conveyor.engine.attention.native_kernel import (
    HEAD_DIMS,
    KERNEL_PATHS,
    PREFILL_PATHS,
    load_decode_kernel,
    prefill_path_from_env,
    resolve_prefill_path,
)
from conveyor.engine.attention.torch_backend import TorchAttentionBackend
from conveyor.engine.attention.torch_plan import TorchAttentionPlan, build_plan

log = logging.getLogger("conveyor.engine.attention")

POOL_DTYPES = {torch.float32: (torch.float32, torch.float16),
               torch.bfloat16: (torch.bfloat16, torch.float16)}
"""The model dtypes the kernels take (queries, keys, values) and the pools each reads (float16:
kv_cache_dtype float16, widened as read)."""


@dataclass(slots=True)
class PrefillRows:
    """The step's prefill chunks (requests with more than one new token) for the kernel."""

    block_tables: torch.Tensor
    """[Rp, W] int32, contiguous."""
    seq_lens: torch.Tensor
    """[Rp] int64: context length after this step."""
    query_starts: torch.Tensor
    """[Rp] int64: flat index of each chunk's first token."""
    query_lens: torch.Tensor
    """[Rp] int64."""


@dataclass(slots=True)
class NativeAttentionPlan:
    """One step: its slots, the decode rows for the decode kernel, the prefill chunks for
    the prefill kernel (or torch's plan, CONVEYOR_PREFILL_ATTENTION=torch)."""

    slot_mapping: torch.Tensor
    decode_tokens: torch.Tensor | None
    """[Nd] flat index of the decode tokens, or None when every token decodes."""
    block_tables: torch.Tensor
    """[Nd, W] int32, contiguous: the decode rows' block tables."""
    seq_lens: torch.Tensor
    """[Nd] int64: the decode rows' context lengths."""
    prefill: PrefillRows | TorchAttentionPlan | None
    """The prefill chunks; None in a decode-only step."""


class NativeAttentionBackend:
    """Backend `native`: per layer, the new K/V rows stored into the pool by one C++ call,
    then the C++ prefill kernel for the step's prefill chunks and the decode kernel for its
    decode tokens (queries read where the qkv projection wrote them, no copy)."""

    name = "native"

    def __init__(self, spec: AttentionSpec, kernel_path: str = "auto",
                 prefill_path: str | None = None) -> None:
        """kernel_path: a key of native_kernel.KERNEL_PATHS (auto: the best this CPU runs);
        prefill_path: one of PREFILL_PATHS or auto (None: CONVEYOR_PREFILL_ATTENTION, else
        auto; resolve_prefill_path)."""
        if spec.head_dim not in HEAD_DIMS:
            raise ValueError(f"attention backend native supports head_dim {HEAD_DIMS}, the "
                             f"model has {spec.head_dim}; set attention_backend torch")
        self.spec = spec
        self._kernel = load_decode_kernel()
        self.use_kernel_path(kernel_path)
        prefill_path = prefill_path_from_env() if prefill_path is None else prefill_path
        prefill_path = resolve_prefill_path(prefill_path, spec.dtype)
        if prefill_path not in PREFILL_PATHS:
            raise ValueError(f"prefill_path {prefill_path!r} is not one of "
                             f"{tuple(PREFILL_PATHS)}")
        if prefill_path == "native-avx512" and not self._kernel.has_avx512():
            raise ValueError("prefill_path native-avx512 needs AVX-512, which this CPU lacks")
        self.prefill_path = prefill_path
        self._prefill_isa = PREFILL_PATHS[prefill_path]
        self._torch = TorchAttentionBackend(spec)
        wide = prefill_path == "native-avx512" or (prefill_path == "native"
                                                    and self._kernel.has_avx512())
        self.prefill_kernel = ("torch SDPA" if self._prefill_isa is None
                               else "avx512" if wide else "avx2")
        """What prefill chunks run through: the prefill kernel's path, or torch SDPA."""
        log.info("attention backend native: decode tokens through the C++ kernel %s (%s), "
                 "prefill chunks through %s", self._kernel.__file__, self.kernel_path,
                 self.prefill_kernel)

    def use_kernel_path(self, kernel_path: str) -> None:
        """Decode through `kernel_path` from now on (a key of native_kernel.KERNEL_PATHS)."""
        if kernel_path not in KERNEL_PATHS:
            raise ValueError(f"kernel_path {kernel_path!r} is not one of {list(KERNEL_PATHS)}")
        if kernel_path == "auto":
            kernel_path = "avx512" if self._kernel.has_avx512() else "avx2"
        elif kernel_path.startswith("avx512") and not self._kernel.has_avx512():
            raise ValueError(f"kernel_path {kernel_path} needs AVX-512, which this CPU lacks")
        self.kernel_path = kernel_path
        self._path = KERNEL_PATHS[kernel_path]

    def plan(self, meta: AttentionMetadata) -> NativeAttentionPlan:
        if meta.is_decode_only:
            return NativeAttentionPlan(meta.slot_mapping, None, meta.block_tables.contiguous(),
                                       meta.seq_lens.contiguous(), None)
        query_lens = meta.query_start_loc.diff()
        decode_rows = (query_lens == 1).nonzero().squeeze(1)
        if self._prefill_isa is None:
            prefill = build_plan(meta, self.spec.sliding_window, with_decode=False)
        else:
            rows = (query_lens > 1).nonzero().squeeze(1)
            prefill = PrefillRows(block_tables=meta.block_tables.index_select(0, rows),
                                  seq_lens=meta.seq_lens.index_select(0, rows),
                                  query_starts=meta.query_start_loc.index_select(0, rows),
                                  query_lens=query_lens.index_select(0, rows))
        return NativeAttentionPlan(
            slot_mapping=meta.slot_mapping,
            decode_tokens=meta.query_start_loc.index_select(0, decode_rows),
            block_tables=meta.block_tables.index_select(0, decode_rows),
            seq_lens=meta.seq_lens.index_select(0, decode_rows),
            prefill=prefill)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, plan: NativeAttentionPlan) -> torch.Tensor:
        if kv_cache.dtype not in POOL_DTYPES.get(query.dtype, ()):
            raise ValueError(f"attention backend native does not read {query.dtype} queries "
                             f"over a {kv_cache.dtype} KV pool (float32 over float32 or "
                             "float16, bfloat16 over bfloat16 or float16); set dtype float32 or "
                             "bfloat16, or attention_backend torch")
        self._kernel.store_kv(kv_cache, _heads_contiguous(key), _heads_contiguous(value),
                              plan.slot_mapping)
        if plan.prefill is None:
            return self._decode(query, kv_cache, plan)
        out = self._prefill(query, kv_cache, plan.prefill)
        if plan.decode_tokens.numel():
            decoded = self._decode(query.index_select(0, plan.decode_tokens), kv_cache, plan)
            out.index_copy_(0, plan.decode_tokens, decoded)
        return out

    def _prefill(self, query: torch.Tensor, kv_cache: torch.Tensor,
                 prefill: PrefillRows | TorchAttentionPlan) -> torch.Tensor:
        """Attention of the prefill chunks' tokens; the other rows are left undefined."""
        if isinstance(prefill, TorchAttentionPlan):
            return self._torch.attend(query, kv_cache, prefill)
        query = _heads_contiguous(query)
        out = torch.empty(query.shape, dtype=query.dtype)
        self._kernel.paged_prefill_attention(out, query, kv_cache, prefill.block_tables,
                                             prefill.seq_lens, prefill.query_starts,
                                             prefill.query_lens, self.spec.scale,
                                             self.spec.sliding_window or 0, self._prefill_isa)
        return out

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
                plan: NativeAttentionPlan) -> torch.Tensor:
        query = _heads_contiguous(query)
        out = torch.empty(query.shape, dtype=query.dtype)
        self._kernel.paged_decode_attention(out, query, kv_cache, plan.block_tables,
                                            plan.seq_lens, self.spec.scale,
                                            self.spec.sliding_window or 0, self._path)
        return out


def _heads_contiguous(rows: torch.Tensor) -> torch.Tensor:
    """rows [T, H, D] as the kernels take them: each row's heads contiguous, the rows may be
    strided (the q, k and v views of the qkv projection's output pass as they are)."""
    if rows.stride(2) == 1 and (rows.shape[1] == 1 or rows.stride(1) == rows.shape[2]):
        return rows
    return rows.contiguous()
