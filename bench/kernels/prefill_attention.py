"""Causal prefill attention: the torch plan against the native kernel and torch alternatives.

A chunk of L tokens after C cached ones (--contexts C:L,...), its blocks shuffled in the pool,
through the backends as a step runs them: the torch backend's plan (gather + masked SDPA)
against the native backend's prefill kernel on each of --paths (CONVEYOR_PREFILL_ATTENTION
values); --dtype bfloat16 runs them as a bf16 model does (bf16 queries over a bf16 pool).
--lengths L,... runs first chunks (C = 0) and also these torch arrangements over the gathered
keys and values ([1, 3, L, 64] views of the gather buffer, as the plan passes them):

  sdpa        F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)
  sdpa-math   the same with the math path forced (matmul + softmax inside SDPA)
  sdpa-exp    SDPA on contiguous, GQA-expanded keys and values
  folded      a KV head's 3 query heads folded into one [3L, 64] x [64, L] matmul, causal
              mask, softmax, matmul with the values (no GQA expansion)
  folded-N    folded by query chunks of N rows, each against the keys up to its last row
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from bench.kernels.harness import compare, markdown_table
from conveyor.engine.attention.backend import AttentionSpec
from conveyor.engine.attention.metadata import AttentionMetadata
from conveyor.engine.attention.native_backend import NativeAttentionBackend
from conveyor.engine.attention.torch_backend import TorchAttentionBackend

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
SPEC = AttentionSpec(HEADS, KV_HEADS, DIM, DIM ** -0.5)


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=DIM ** -0.5,
                                          enable_gqa=True)


def sdpa_math(q, k, v):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return sdpa(q, k, v)


def sdpa_expanded(q, k, v):
    group = HEADS // KV_HEADS
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True,
        scale=DIM ** -0.5)


def folded(q, k, v, chunk: int | None = None):
    """A KV head's query heads as one matmul, by query chunks of `chunk` rows (None: all)."""
    b, h, length, d = q.shape
    group, chunk = h // KV_HEADS, chunk or length
    out = q.new_empty(b, KV_HEADS, group, length, d)
    qg = q.view(b, KV_HEADS, group, length, d)
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        rows = end - start
        qc = qg[:, :, :, start:end].reshape(b, KV_HEADS, group * rows, d)
        scores = torch.matmul(qc, k[:, :, :end].transpose(-1, -2)).mul_(d ** -0.5)
        mask = torch.full((rows, end), float("-inf")).triu_(start + 1)
        scores = scores.view(b, KV_HEADS, group, rows, end).add_(mask)
        probs = torch.softmax(scores, dim=-1).view(b, KV_HEADS, group * rows, end)
        out[:, :, :, start:end] = torch.matmul(probs, v[:, :, :end]).view(
            b, KV_HEADS, group, rows, d)
    return out.view(b, h, length, d)


ALTERNATIVES = {"sdpa": sdpa, "sdpa-math": sdpa_math, "sdpa-exp": sdpa_expanded,
                "folded": folded, "folded-256": functools.partial(folded, chunk=256),
                "folded-128": functools.partial(folded, chunk=128)}


def _alternative(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    return lambda: fn(q, k, v)[0].transpose(0, 1)  # [1, H, L, D] -> the token rows [L, H, D]


def chunk(context: int, length: int, paths: list[str], dtype: torch.dtype,
          alternatives: bool) -> dict[str, Callable[[], torch.Tensor]]:
    """The torch plan, the native kernel on each path and (a first chunk) the alternatives."""
    g = torch.Generator().manual_seed(0)
    total = context + length
    blocks = -(-total // BLOCK)
    pool = torch.randn(2, blocks + 1, BLOCK, KV_HEADS, DIM, generator=g).to(dtype)
    q = torch.randn(length, HEADS, DIM, generator=g).to(dtype)
    positions = torch.arange(context, total)
    table = torch.randperm(blocks + 1)[:blocks].int()
    meta = AttentionMetadata(
        slot_mapping=positions, positions=positions, token_request=torch.zeros_like(positions),
        query_start_loc=torch.tensor([0, length]), seq_lens=torch.tensor([total]),
        block_tables=table[None], block_size=BLOCK, max_query_len=length, max_seq_len=total)
    torch_backend = TorchAttentionBackend(SPEC)
    fns = {"torch": functools.partial(torch_backend.attend, q, pool, torch_backend.plan(meta))}
    for path in paths:
        native = NativeAttentionBackend(SPEC, prefill_path=path)
        fns[path] = functools.partial(native._prefill, q, pool, native.plan(meta).prefill)
    if alternatives:
        k, v = (pool[i, table].flatten(0, 1).transpose(0, 1)[None] for i in range(2))
        fns |= {name: _alternative(fn, q.transpose(0, 1)[None], k, v)
                for name, fn in ALTERNATIVES.items()}
    return fns


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="64,128,256,512,1024,2048",
                   help="first chunks' tokens, with the torch alternatives (multiples of 16)")
    p.add_argument("--contexts", help="C:L pairs: a chunk of L tokens after C cached")
    p.add_argument("--paths", default="native", help="e.g. native-avx2,native-avx512")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the model dtype (queries and pool)")
    p.add_argument("--rounds", type=int, default=5, help="turns each variant takes")


def run(args: argparse.Namespace) -> None:
    pairs = ([tuple(map(int, pair.split(":"))) for pair in args.contexts.split(",")]
             if args.contexts else [(0, int(length)) for length in args.lengths.split(",")])
    table = []
    for context, length in tqdm(pairs, unit="chunk", leave=False):
        fns = chunk(context, length, args.paths.split(","), getattr(torch, args.dtype),
                    alternatives=not args.contexts)
        flops = 4 * HEADS * DIM * length * (context + (length + 1) / 2)  # causal
        table += [{"context": context, "chunk": length, **row,
                   "GFLOP/s": flops / row["ms"] / 1e6}
                  for row in compare(fns, args.rounds, reps=max(3, 2048 // length))]
    print(markdown_table(table))
