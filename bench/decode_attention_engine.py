"""Engine-level A/B of decode attention: the offline engine (bundled SmolLM2-135M, fp32)
once per attention setting in one process, taking turns, on the issue's concurrency-16
workloads (random-token prompts, 64 output tokens, ignore_eos):

  plain    16 requests of 256-token prompts
  prefix   16 requests of a shared 512-token prefix + 256 own tokens (prefix cached
           after the first request's prefill)

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.decode_attention_engine [--threads 2]
        [--rounds 2] [--backends native:avx2 native:avx512-cascade native:avx512]

A setting is `torch` or `native:<kernel path>` (native_kernel.KERNEL_PATHS). Prints per
round, workload and setting: output tok/s, TPOT p50 (ms), TTFT p50 (ms), and the steady
decode gap p50 (ms: the gaps between tokens after every request's first token, i.e. steps
with no prefill chunk, the part decode attention sets); per round and setting the
prefix/plain ratios of TPOT (issue 19's target: at most 1.10) and of the steady gap; the
load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics

from bench.inprocess_engine import make_llm, run_inprocess
from bench.serving.client import RequestResult
from bench.serving.workload import BenchRequest

VOCAB_LOW, VOCAB_HIGH = 100, 49152


def workload(kind: str, num_requests: int, output_len: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(512)] if kind == "prefix" else []
    requests = []
    for _ in range(num_requests):
        ids = prefix + [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(256)]
        requests.append(BenchRequest(prompt=ids, prompt_len=len(ids), max_tokens=output_len))
    return requests


def steady_gap_ms(results: list[RequestResult]) -> float:
    """p50 of the inter-token gaps that end after the last request's first token (ms)."""
    last_first = max(r.start_time + r.ttft for r in results)
    gaps = []
    for r in results:
        t = r.start_time + r.ttft
        for gap in r.itl:
            t += gap
            if t > last_first:
                gaps.append(gap)
    return statistics.median(gaps) * 1e3 if gaps else float("nan")


def make_setting(setting: str, threads: int):
    """The offline engine for `torch` or `native:<kernel path>`."""
    name, _, kernel_path = setting.partition(":")
    llm = make_llm(attention_backend=name, torch_threads=threads, enable_prefix_caching=True)
    if kernel_path:
        # every layer holds the one backend the loader built
        model = llm.core._isolating.runner.model  # noqa: SLF001 - a benchmark's reach-in
        model.model.layers[0].self_attn.backend.use_kernel_path(kernel_path)
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--backends", nargs="+",
                        default=["native:avx2", "native:avx512-cascade", "native:avx512"])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}, threads {args.threads}")
    llms = {setting: make_setting(setting, args.threads) for setting in args.backends}
    rows = []
    for round_index in range(args.rounds):
        tpot = {}
        for kind in ("plain", "prefix"):
            # a fresh seed per round: the prefix cache of an earlier round cannot help
            requests = workload(kind, args.concurrency, args.output_len, seed=round_index * 10
                                + (kind == "prefix"))
            for setting, llm in llms.items():
                metrics, results = run_inprocess(llm, list(requests), args.concurrency)
                steady = steady_gap_ms(results)
                tpot[kind, setting] = metrics.tpot.p50, steady
                rows.append({"round": round_index, "workload": kind, "backend": setting,
                             "output_tok_s": metrics.output_throughput,
                             "tpot_p50_ms": metrics.tpot.p50, "ttft_p50_ms": metrics.ttft.p50,
                             "steady_gap_p50_ms": steady})
                print(f"round {round_index} {kind:6s} {setting:22s} | "
                      f"{metrics.output_throughput:6.1f} tok/s TPOT {metrics.tpot.p50:6.1f} "
                      f"TTFT {metrics.ttft.p50:7.0f} steady gap {steady:6.1f} | "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)
        for setting in llms:
            (prefix_tpot, prefix_gap), (plain_tpot, plain_gap) = (tpot["prefix", setting],
                                                                  tpot["plain", setting])
            print(f"round {round_index} {setting:22s} prefix/plain TPOT "
                  f"{prefix_tpot / plain_tpot:.2f}, steady gap {prefix_gap / plain_gap:.2f}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
