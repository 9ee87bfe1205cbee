"""Decode attention alone: the torch backend (block gather + SDPA) against `native` (the
C++ kernel reading the pool in place) on each of its code paths, at SmolLM2-135M's shapes
(9 query heads over 3 KV heads, head_dim 64, block 16), one decode step of N requests over
30 layers' pools.

    .venv/bin/python bench/decode_attention.py [--threads 2] [--layers 30] [--repeats 7]
        [--paths avx2 avx512-cascade avx512] [--fp16-pools] [--bf16]

Scenarios: N in {16, 64} x context in {256, 768}, plain (every request its own blocks)
and shared-prefix (the first 2/3 of the context, 512 of 768 / 160 of 256 tokens, in
blocks every request shares, as a cached system prompt gives). Each step walks a
separate pool per layer, so K/V stream from DRAM as in the engine (a single layer's pool
would sit in L3). Printed per scenario: ms per step (all layers, best of --repeats, the
backends taking turns) of torch and of each native path (--paths, names of
native_kernel.KERNEL_PATHS; the AVX-512 one where the CPU has it), each path's speedup
over the first path, the step's distinct K/V bytes over the DRAM read bandwidth measured in
the same run (the floor for a kernel that reads every distinct byte once), and the max abs
difference of any native path from torch.
With --fp16-pools each native path also runs over the same pools rounded to fp16
(kv_cache_dtype float16), named "<path>/fp16", its speedup over the first path in fp32; the
fp16 pools' floor (half the bytes) and the fp16 paths' difference from torch over the fp32
pools (the rounding's cost) are printed after the fp32 ones.
With --bf16 the step also runs as a bf16 model runs it: bf16 queries, keys and values over the
pools rounded to bf16, through torch ("torch/bf16": the path a bf16 engine took before the
kernels read bf16) and each native path ("<path>/bf16"), each one's speedup over the first path
in fp32; their difference from torch in fp32 is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from conveyor.engine.attention import AttentionMetadata, AttentionSpec, create_backend
from conveyor.engine.attention.native_backend import NativeAttentionBackend
from conveyor.engine.attention.native_kernel import load_decode_kernel

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


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
    """DRAM read bandwidth with torch's threads: best of 5 sums over a buffer >> L3."""
    buf = torch.ones(size_mb * 2 ** 20 // 4)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


def time_steps(backends: dict, meta, rows: dict,
               repeats: int) -> dict[str, tuple[float, torch.Tensor]]:
    """Best-of-`repeats` ms per step of each backend (name -> (backend, its pools)) over the
    query, key and value rows of its pools' model dtype (rows: dtype -> (q, k, v)), the
    backends taking turns step by step (the machine is shared: the minimum of interleaved
    runs is the robust figure)."""
    times = {name: [] for name in backends}
    outs = {}
    for repeat in range(repeats + 1):  # the first round warms up (workspace, page faults)
        for name, (backend, pools) in backends.items():
            query, key, value = rows[torch.bfloat16 if name.endswith("/bf16") else torch.float32]
            start = time.perf_counter()
            plan = backend.plan(meta)
            for pool in pools:
                outs[name] = backend.forward(query, key, value, pool, plan)
            if repeat:
                times[name].append(time.perf_counter() - start)
    return {name: (min(times[name]) * 1e3, outs[name]) for name in backends}


def run_scenario(num_seqs: int, context: int, shared: int, args, bandwidth: float) -> dict:
    meta = decode_step(num_seqs, context, shared)
    num_blocks = int(meta.block_tables.max()) + 1
    gen = torch.Generator().manual_seed(1)
    pools = [torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
             for _ in range(args.layers)]
    query = torch.randn(num_seqs, HEADS, HEAD_DIM, generator=gen)
    key, value = (torch.randn(num_seqs, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    spec = AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    backends = {"torch": (create_backend("torch", spec), pools)}
    backends.update({path: (NativeAttentionBackend(spec, path), pools) for path in args.paths})
    if args.fp16_pools:
        half = [pool.half() for pool in pools]
        backends.update({f"{path}/fp16": (NativeAttentionBackend(spec, path), half)
                         for path in args.paths})
    if args.bf16:
        bf16 = [pool.bfloat16() for pool in pools]
        backends["torch/bf16"] = (create_backend("torch", spec), bf16)
        backends.update({f"{path}/bf16": (NativeAttentionBackend(spec, path), bf16)
                         for path in args.paths})
    rows = {torch.float32: (query, key, value),
            torch.bfloat16: (query.bfloat16(), key.bfloat16(), value.bfloat16())}
    timed = time_steps(backends, meta, rows, args.repeats)
    kv_bytes = num_blocks * BLOCK * KV_HEADS * HEAD_DIM * 4 * 2 * args.layers
    torch_out = timed["torch"][1]

    def diff(names):
        return max((float((timed[n][1].float() - torch_out).abs().max()) for n in names),
                   default=0.0)

    fp16_names = [name for name in timed if name.endswith("/fp16")]
    bf16_names = [name for name in timed if name.endswith("/bf16")]
    return {"num_seqs": num_seqs, "context": context, "shared": shared,
            "ms": {name: round(ms, 2) for name, (ms, _) in timed.items()},
            "floor_ms": round(kv_bytes / bandwidth / 1e6, 2),
            "max_abs_diff": diff(args.paths), "fp16_max_abs_diff": diff(fp16_names),
            "bf16_max_abs_diff": diff(bf16_names)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seqs", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 768])
    parser.add_argument("--paths", nargs="+", default=["avx2", "avx512-cascade", "avx512"],
                        help="native kernel paths to time (native_kernel.KERNEL_PATHS)")
    parser.add_argument("--fp16-pools", action="store_true",
                        help="also run each native path over the pools rounded to fp16")
    parser.add_argument("--bf16", action="store_true",
                        help="also run the step as a bf16 model does (torch and each path)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if not load_decode_kernel().has_avx512():
        args.paths = [path for path in args.paths if not path.startswith("avx512")]
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth_gbs()
    print(f"threads {args.threads}, load average {os.getloadavg()[0]:.2f}, "
          f"DRAM read {bandwidth:.1f} GB/s")
    first = args.paths[0]
    args.paths_timed = list(args.paths)
    if args.fp16_pools:
        args.paths_timed += [f"{p}/fp16" for p in args.paths]
    if args.bf16:
        args.paths_timed += ["torch/bf16", *(f"{p}/bf16" for p in args.paths)]
    print("  N  ctx shared | torch ms | "
          + " | ".join(f"{p} ms (x vs {first})" for p in args.paths_timed)
          + " | K/V floor ms | max abs diff")
    rows = []
    for num_seqs in args.seqs:
        for context in args.contexts:
            for shared in (0, (context * 2 // 3) // BLOCK * BLOCK):
                row = run_scenario(num_seqs, context, shared, args, bandwidth)
                rows.append(row)
                ms = row["ms"]
                paths = " | ".join(f"{ms[p]:7.2f} ({ms[first] / ms[p]:.2f}x)"
                                   for p in args.paths_timed)
                fp16 = (f" | fp16: floor {row['floor_ms'] / 2:.2f}, diff "
                        f"{row['fp16_max_abs_diff']:.1e}" if args.fp16_pools else "")
                fp16 += (f" | bf16 diff {row['bf16_max_abs_diff']:.1e}" if args.bf16 else "")
                print(f"{num_seqs:3d} {context:4d} {shared:6d} | {ms['torch']:8.2f} | {paths} | "
                      f"{row['floor_ms']:12.2f} | {row['max_abs_diff']:.1e}{fp16}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "bandwidth_gbs": bandwidth, "paths": args.paths,
                       "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
