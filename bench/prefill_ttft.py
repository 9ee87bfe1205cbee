"""Time to first token in process (one request alone: its prefill and first sample), A/B.

Each variant runs in a fresh process, the variants alternating, `--rounds` times; a process
times `--reps` prefills of random prompts at each length after two untimed ones. Variants are
environment settings, e.g. CONVEYOR_SWIGLU=off (the torch SwiGLU) against the default.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.prefill_ttft --lengths 256,1024 \\
        --variant torch=CONVEYOR_SWIGLU=off --variant fused=
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time


def child(lengths: list[int], reps: int, threads: int) -> None:
    from conveyor.engine import LLM
    from conveyor.engine.sampling_params import SamplingParams

    llm = LLM(max_num_seqs=4, kv_cache_gib=0.5, max_model_len=max(lengths) + 16,
              torch_threads=threads)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    out = {}
    for length in lengths:
        times = []
        for i in range(reps + 2):
            prompt = [rng.randrange(100, 40000) for _ in range(length)]
            start = time.perf_counter()
            llm.generate([prompt], params)
            if i >= 2:
                times.append((time.perf_counter() - start) * 1e3)
        out[length] = statistics.median(times)
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="256,1024")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=ENV1=V1,ENV2=V2 (NAME= for the environment as it is)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.child:
        return child(lengths, args.reps, args.threads)
    variants = {}
    for spec in args.variant or ["default="]:
        name, _, env = spec.partition("=")
        variants[name] = dict(kv.split("=", 1) for kv in env.split(",") if kv)
    results = {name: {n: [] for n in lengths} for name in variants}
    for _ in range(args.rounds):
        for name, env in variants.items():
            proc = subprocess.run(
                [sys.executable, "-m", "bench.prefill_ttft", "--child", "--lengths", args.lengths,
                 "--reps", str(args.reps), "--threads", str(args.threads)],
                env={**os.environ, **env}, capture_output=True, text=True, check=True)
            line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULT "))
            for n, ms in json.loads(line[7:]).items():
                results[name][int(n)].append(ms)
            print(name, line[7:], flush=True)
    base = next(iter(variants))
    for n in lengths:
        ref = statistics.median(results[base][n])
        print(f"{n} tokens: " + "  ".join(
            f"{name} {statistics.median(r[n]):.1f} ms (x{ref / statistics.median(r[n]):.3f})"
            for name, r in results.items()))


if __name__ == "__main__":
    main()
