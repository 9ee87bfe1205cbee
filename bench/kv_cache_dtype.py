"""The KV pool's element type (CONVEYOR_ENGINE_KV_CACHE_DTYPE) A/B, in process: output tok/s of
the offline engine with an fp32 pool (auto) and an fp16 one, rounds alternating in one run.

Workloads (closed loop, bench/inprocess_engine.py; 64 output tokens, ignore_eos, random
token prompts, the peer suite's shapes):
- c16: 16 in flight, 256-token prompts;
- c16-prefix: 16 in flight, a 512-token prefix every prompt shares (cached after the first
  request, as a system prompt is) + 256 tokens of its own;
- c64: 64 in flight, 256-token prompts.
Prints each round's tok/s per pool and the median ratio fp16 / fp32 per workload.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.kv_cache_dtype [--threads 2] [--rounds 2]
        [--workloads c16,c16-prefix,c64] [--weight-format fp32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

PROMPT_LEN, PREFIX_LEN, OUTPUT_LEN = 256, 512, 64
WORKLOADS = {"c16": (16, 0, 48), "c16-prefix": (16, PREFIX_LEN, 48), "c64": (64, 0, 128)}
"""name -> (concurrency, shared prefix tokens, requests)."""


def workload_requests(name: str, seed: int):
    from bench.engine_step_bench import random_prompts
    from bench.serving.workload import BenchRequest

    _, prefix_len, count = WORKLOADS[name]
    prefix = random_prompts(1, prefix_len, seed=seed + 1)[0] if prefix_len else []
    own = random_prompts(count, PROMPT_LEN, seed=seed)
    return [BenchRequest(prefix + p, prefix_len + PROMPT_LEN, OUTPUT_LEN) for p in own]


def main(argv: list[str] | None = None) -> int:
    from bench.inprocess_engine import make_llm, run_inprocess

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--weight-format", default="fp32")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    workloads = args.workloads.split(",")
    llms = {dtype: make_llm(max_num_seqs=64, kv_cache_gib=2.0, max_model_len=2048,
                            torch_threads=args.threads, weight_format=args.weight_format,
                            kv_cache_dtype=dtype)
            for dtype in ("auto", "float16")}
    for llm in llms.values():  # warm-up: first-call allocations, oneDNN primitives
        run_inprocess(llm, workload_requests("c16", 99)[:2], 2)
    rows: dict[str, dict[str, list[float]]] = {w: {d: [] for d in llms} for w in workloads}
    print(f"threads {args.threads}, weights {args.weight_format}, load "
          f"{os.getloadavg()[0]:.2f}")
    for round_ in range(args.rounds):
        for name in workloads:
            for dtype, llm in (llms.items() if round_ % 2 == 0 else reversed(llms.items())):
                # a fresh seed per round: no prompt is in the prefix cache from before
                requests = workload_requests(name, seed=100 * round_ + 7)
                metrics, _ = run_inprocess(llm, requests, WORKLOADS[name][0])
                rows[name][dtype].append(metrics.output_throughput)
                print(f"round {round_} {name:10s} kv {dtype:7s} "
                      f"{metrics.output_throughput:7.1f} tok/s", flush=True)
    summary = {}
    for name, by_dtype in rows.items():
        ratios = [h / f for h, f in zip(by_dtype["float16"], by_dtype["auto"], strict=True)]
        summary[name] = {"fp32_tok_s": by_dtype["auto"], "fp16_tok_s": by_dtype["float16"],
                         "median_ratio": statistics.median(ratios)}
        print(f"{name:10s} fp16 / fp32 pool: {statistics.median(ratios):.2f}x "
              f"(rounds {', '.join(f'{r:.2f}' for r in ratios)})")
    if args.json:
        args.json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "threads": args.threads, "weight_format": args.weight_format,
            "command": "python -m bench.kv_cache_dtype " + " ".join(argv or sys.argv[1:]),
            "workloads": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
