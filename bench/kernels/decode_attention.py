"""Decode attention alone: the torch backend against the native kernel on each of its paths.

One decode step of N requests (--seqs) at each context (--contexts) over 30 layers' pools at
SmolLM2-135M's shapes (9 query heads over 3 KV heads, head_dim 64, block 16), plain and with
the first 2/3 of the context in blocks every request shares (a cached system prompt). Each layer
has its own pool, so K/V stream from DRAM as in the engine. Per backend (torch: block gather +
SDPA; a native path: C++ reading the pool in place): ms per step, speed-up over torch, largest
difference from torch, and the floor (the step's distinct K/V bytes over the DRAM read bandwidth
of the same run). --fp16-pools adds each path over fp16 pools ("<path>/fp16"); --bf16 runs the
step as a bf16 model does, bf16 rows over bf16 pools ("torch/bf16", "<path>/bf16").
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable

import torch
from tqdm import tqdm

from bench.kernels.harness import compare, markdown_table, time_rounds
from conveyor.engine.attention import AttentionMetadata, AttentionSpec, create_backend
from conveyor.engine.attention.native_backend import NativeAttentionBackend
from conveyor.engine.attention.native_kernel import load_decode_kernel

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
SPEC = AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)


def decode_step(num_seqs: int, context: int, shared: int, seed: int = 0) -> AttentionMetadata:
    """Block tables of `num_seqs` requests at `context` tokens whose first `shared` tokens'
    blocks are the same physical blocks; the rest of the pool's blocks are shuffled."""
    own = -(-context // BLOCK) - shared // BLOCK
    ids = list(range(shared // BLOCK + num_seqs * own))
    random.Random(seed).shuffle(ids)
    prefix, rest = ids[:shared // BLOCK], ids[shared // BLOCK:]
    tables = torch.tensor([prefix + rest[i * own:(i + 1) * own] for i in range(num_seqs)],
                          dtype=torch.int32)
    last = context - 1
    slots = tables[:, last // BLOCK].long() * BLOCK + last % BLOCK
    return AttentionMetadata(
        slot_mapping=slots, positions=torch.full((num_seqs,), last),
        token_request=torch.arange(num_seqs), query_start_loc=torch.arange(num_seqs + 1),
        seq_lens=torch.full((num_seqs,), context), block_tables=tables, block_size=BLOCK,
        max_query_len=1, max_seq_len=context)


def read_bandwidth_gbs(size_mb: int = 1024) -> float:
    """DRAM read bandwidth with torch's threads: sums over a buffer much larger than L3."""
    buf = torch.ones(size_mb * 2 ** 20 // 4)
    return buf.numel() * 4 / time_rounds({"read": buf.sum}, rounds=5)["read"].median / 1e9


def _step(backend, meta: AttentionMetadata, pools: list[torch.Tensor],
          qkv: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:  # the plan, then attention over every layer's pool
        plan = backend.plan(meta)
        for pool in pools:
            out = backend.forward(*qkv, pool, plan)
        return out
    return step


def _steps(args: argparse.Namespace, meta: AttentionMetadata,
           pools: list[torch.Tensor]) -> dict[str, Callable[[], torch.Tensor]]:
    """Each backend's step: torch and the paths in fp32, then over fp16 or bf16 pools."""
    gen = torch.Generator().manual_seed(1)
    qkv = [torch.randn(meta.seq_lens.numel(), heads, HEAD_DIM, generator=gen)
           for heads in (HEADS, KV_HEADS, KV_HEADS)]
    variants = {"": (pools, qkv)}
    if args.fp16_pools:
        variants["/fp16"] = ([pool.half() for pool in pools], qkv)
    if args.bf16:
        variants["/bf16"] = ([pool.bfloat16() for pool in pools], [t.bfloat16() for t in qkv])
    steps = {}
    for suffix, (layer_pools, rows) in variants.items():
        backends = {} if suffix == "/fp16" else {"torch": create_backend("torch", SPEC)}
        backends |= {path: NativeAttentionBackend(SPEC, path) for path in args.paths}
        steps |= {name + suffix: _step(backend, meta, layer_pools, rows)
                  for name, backend in backends.items()}
    return steps


def scenario(num_seqs: int, context: int, shared: int, args: argparse.Namespace,
             bandwidth_gbs: float) -> list[dict]:
    """A table row per backend for one decode step."""
    meta = decode_step(num_seqs, context, shared)
    num_blocks = int(meta.block_tables.max()) + 1
    gen = torch.Generator().manual_seed(2)
    pools = [torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
             for _ in range(LAYERS)]
    floor_ms = pools[0].numel() * LAYERS * 4 / bandwidth_gbs / 1e6
    return [{"N": num_seqs, "context": context, "shared": shared, **row,
             "K/V floor ms": floor_ms / 2 if "/" in row["variant"] else floor_ms}
            for row in compare(_steps(args, meta, pools), args.rounds)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seqs", type=int, nargs="+", default=[16, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 768])
    p.add_argument("--paths", nargs="+", default=["avx2", "avx512-cascade", "avx512"],
                   help="native kernel paths (native_kernel.KERNEL_PATHS)")
    p.add_argument("--fp16-pools", action="store_true", help="each path over fp16 pools too")
    p.add_argument("--bf16", action="store_true", help="the step as a bf16 model runs it too")
    p.add_argument("--rounds", type=int, default=7, help="turns each backend takes")


def run(args: argparse.Namespace) -> None:
    if not load_decode_kernel().has_avx512():
        args.paths = [path for path in args.paths if not path.startswith("avx512")]
    bandwidth = read_bandwidth_gbs()
    print(f"DRAM read {bandwidth:.1f} GB/s")
    steps = [(num_seqs, context, shared) for num_seqs in args.seqs for context in args.contexts
             for shared in (0, (context * 2 // 3) // BLOCK * BLOCK)]
    print(markdown_table([row for step in tqdm(steps, unit="step", leave=False)
                          for row in scenario(*step, args, bandwidth)]))
