"""Prefill attention on the CPU: the torch plan's causal SDPA against alternatives.

A first prefill chunk of L tokens (no earlier context) attends causally over itself:
query [1, 9, L, 64], keys and values [1, 3, L, 64] as the torch backend passes them (views
of its gather buffer [L / 16, 16, 3, 64]). Variants, each timed over alternating rounds:

  native      the native backend's prefill kernel (native/csrc/paged_prefill_attention.cpp)
              reading the same buffer as a paged pool
  sdpa        F.scaled_dot_product_attention(is_causal=True, enable_gqa=True) (the torch plan)
  sdpa-math   the same with the math path forced (explicit matmul + softmax inside SDPA)
  sdpa-exp    SDPA on contiguous, GQA-expanded keys and values
  folded      the 3 query heads of a KV head folded into one [3L, 64] x [64, L] matmul,
              additive causal mask, softmax, matmul with the values (no GQA expansion)
  folded-N    folded by query chunks of N rows, each against the keys up to its last row

With --contexts, chunks of L tokens after C cached ones, through the backends as a step runs
them: the torch backend's plan (gather of the context's blocks + masked SDPA) against the
native backend's prefill kernel (nothing gathered), e.g. a 256-token prompt after a cached
512-token system prompt, or the later chunks of a long prompt.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.prefill_attention [--lengths 64,256,1024]
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.prefill_attention --contexts 0:256,512:256,768:256
        [--paths native-avx2,native-avx512] [--dtype bfloat16]

--dtype bfloat16 runs the --contexts chunks as a bf16 model does (bf16 queries over a bf16
pool): the torch plan's SDPA in bf16 (oneDNN brgemm, AMX where the CPU has it) against the
native kernel (bf16 widened to fp32 as read).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def inputs(length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, HEADS, DIM, generator=g)
    buf = torch.randn(2, length // BLOCK, BLOCK, KV_HEADS, DIM, generator=g)
    k = buf[0].view(1, length, KV_HEADS, DIM).transpose(1, 2)
    v = buf[1].view(1, length, KV_HEADS, DIM).transpose(1, 2)
    q = q.view(1, length, HEADS, DIM).transpose(1, 2)
    VARIANTS["native"] = native_over(buf, q)
    return q, k, v


def native_over(pool: torch.Tensor, q: torch.Tensor):
    """The prefill kernel on `pool` (the gather buffer, its blocks in order) as a variant."""
    from conveyor.engine.attention.native_kernel import load_decode_kernel

    kernel = load_decode_kernel()
    length = q.shape[2]
    rows = q[0].transpose(0, 1).contiguous()  # [L, H, D], the engine's token rows
    out = torch.empty_like(rows)
    table = torch.arange(pool.shape[1], dtype=torch.int32)[None]
    lens, starts = torch.tensor([length]), torch.tensor([0])

    def native(q_, k_, v_):
        kernel.paged_prefill_attention(out, rows, pool, table, lens, starts, lens,
                                       DIM ** -0.5, 0, 0)  # isa 0: the widest path
        return out.transpose(0, 1)[None]

    return native


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


def folded(q, k, v):
    b, h, length, d = q.shape
    group = h // KV_HEADS
    qf = q.reshape(b, KV_HEADS, group * length, d)  # [B, Hkv, 3L, D]
    scores = torch.matmul(qf, k.transpose(-1, -2)).mul_(d ** -0.5)  # [B, Hkv, 3L, L]
    mask = torch.full((length, length), float("-inf")).triu_(1)
    scores = scores.view(b, KV_HEADS, group, length, length).add_(mask)
    probs = torch.softmax(scores, dim=-1).view(b, KV_HEADS, group * length, length)
    return torch.matmul(probs, v).view(b, h, length, d)


def folded_blocked(q, k, v, chunk: int = 256):
    """folded, by query chunks of `chunk` rows, each against the keys up to its last row."""
    b, h, length, d = q.shape
    group = h // KV_HEADS
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


VARIANTS = {"sdpa": sdpa, "native": None, "sdpa-math": sdpa_math, "sdpa-exp": sdpa_expanded,
            "folded": folded, "folded-256": folded_blocked,
            "folded-128": lambda q, k, v: folded_blocked(q, k, v, 128)}


def over_context(context: int, length: int, rounds: int, paths: list[str],
                 dtype: torch.dtype = torch.float32) -> str:
    """One chunk of `length` tokens after `context` cached ones: torch plan vs the native
    kernel on each of `paths` (CONVEYOR_PREFILL_ATTENTION values)."""
    from conveyor.engine.attention.backend import AttentionSpec
    from conveyor.engine.attention.metadata import AttentionMetadata
    from conveyor.engine.attention.native_backend import NativeAttentionBackend
    from conveyor.engine.attention.torch_backend import TorchAttentionBackend

    g = torch.Generator().manual_seed(0)
    total = context + length
    blocks = -(-total // BLOCK)
    pool = torch.randn(2, blocks + 1, BLOCK, KV_HEADS, DIM, generator=g).to(dtype)
    q = torch.randn(length, HEADS, DIM, generator=g).to(dtype)
    positions = torch.arange(context, total)
    meta = AttentionMetadata(
        slot_mapping=positions, positions=positions, token_request=torch.zeros_like(positions),
        query_start_loc=torch.tensor([0, length]), seq_lens=torch.tensor([total]),
        block_tables=torch.randperm(blocks + 1)[:blocks].int()[None], block_size=BLOCK,
        max_query_len=length, max_seq_len=total)
    spec = AttentionSpec(HEADS, KV_HEADS, DIM, DIM ** -0.5)
    torch_backend = TorchAttentionBackend(spec)
    torch_plan = torch_backend.plan(meta)
    fns = {"torch plan": lambda: torch_backend.attend(q, pool, torch_plan)}
    for path in paths:
        native = NativeAttentionBackend(spec, prefill_path=path)
        fns[path] = (lambda b, plan: lambda: b._prefill(q, pool, plan.prefill))(
            native, native.plan(meta))
    err = max((fns[p]() - fns["torch plan"]()).float().abs().max().item() for p in paths)
    reps = max(3, 2048 // length)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            times[name].append((time.perf_counter() - start) / reps * 1e3)
    base = statistics.median(times["torch plan"])
    flops = 4 * HEADS * DIM * length * (context + (length + 1) / 2)  # causal
    cells = []
    for path in paths:
        ms = statistics.median(times[path])
        cells.append(f"{path} {ms:7.3f} ms (x{base / ms:4.2f}, {flops / ms / 1e6:5.1f} GFLOP/s)")
    return (f"context {context:5d} + chunk {length:5d}: torch plan {base:7.3f} ms, "
            + ", ".join(cells) + f", err {err:.0e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="64,128,256,512,1024,2048")
    parser.add_argument("--contexts", default=None,
                        help="C:L pairs (a chunk of L tokens after C cached), e.g. 512:256")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--paths", default="native",
                        help="with --contexts: the kernel's paths, e.g. native-avx2,native-avx512")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="with --contexts: the model dtype (queries and pool)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.contexts:
        for pair in args.contexts.split(","):
            context, length = map(int, pair.split(":"))
            print(over_context(context, length, args.rounds, args.paths.split(","),
                               getattr(torch, args.dtype)), flush=True)
        return
    for length in map(int, args.lengths.split(",")):
        q, k, v = inputs(length)
        ref = sdpa(q, k, v)
        reps = max(3, 4096 // length)
        times = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name, fn in VARIANTS.items():
                fn(q, k, v)
                start = time.perf_counter()
                for _ in range(reps):
                    fn(q, k, v)
                times[name].append((time.perf_counter() - start) / reps * 1e3)
        base = statistics.median(times["sdpa"])
        row = [f"L={length:5d}"]
        for name, fn in VARIANTS.items():
            err = (fn(q, k, v) - ref).abs().max().item()
            ms = statistics.median(times[name])
            row.append(f"{name} {ms:7.3f} ms (x{base / ms:4.2f}, err {err:.0e})")
        print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
