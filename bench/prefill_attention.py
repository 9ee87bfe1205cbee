"""Prefill attention on the CPU: the torch plan's causal SDPA against alternatives.

A first prefill chunk of L tokens (no earlier context) attends causally over itself:
query [1, 9, L, 64], keys and values [1, 3, L, 64] as the torch backend passes them (views
of its gather buffer [L / 16, 16, 3, 64]). Variants, each timed over alternating rounds:

  sdpa        F.scaled_dot_product_attention(is_causal=True, enable_gqa=True) (current)
  sdpa-math   the same with the math path forced (explicit matmul + softmax inside SDPA)
  sdpa-exp    SDPA on contiguous, GQA-expanded keys and values
  folded      the 3 query heads of a KV head folded into one [3L, 64] x [64, L] matmul,
              additive causal mask, softmax, matmul with the values (no GQA expansion)
  folded-N    folded by query chunks of N rows, each against the keys up to its last row

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.prefill_attention [--lengths 64,256,1024]
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
    return q.view(1, length, HEADS, DIM).transpose(1, 2), k, v


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


VARIANTS = {"sdpa": sdpa, "sdpa-math": sdpa_math, "sdpa-exp": sdpa_expanded, "folded": folded,
            "folded-256": folded_blocked,
            "folded-128": lambda q, k, v: folded_blocked(q, k, v, 128)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="64,128,256,512,1024,2048")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
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
