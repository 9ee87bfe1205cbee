"""Engine-level A/B of the attention backends: the offline engine (bundled SmolLM2-135M,
fp32) with `torch` and with `native` in one process, taking turns, on the issue's
concurrency-16 workloads (random-token prompts, 64 output tokens, ignore_eos):

  plain    16 requests of 256-token prompts
  prefix   16 requests of a shared 512-token prefix + 256 own tokens (prefix cached
           after the first request's prefill)

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.decode_attention_engine [--threads 2] [--rounds 2]

Prints per round and backend: output tok/s, TPOT p50 (ms), TTFT p50 (ms), and the
native/torch ratios; the load average at the start.
"""

from __future__ import annotations

import argparse
import json
import os
import random

from bench.inprocess_engine import make_llm, run_inprocess
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}, threads {args.threads}")
    llms = {name: make_llm(attention_backend=name, torch_threads=args.threads,
                           enable_prefix_caching=True)
            for name in ("torch", "native")}
    rows = []
    for round_index in range(args.rounds):
        for kind in ("plain", "prefix"):
            # a fresh seed per round: the prefix cache of an earlier round cannot help
            requests = workload(kind, args.concurrency, args.output_len, seed=round_index * 10
                                + (kind == "prefix"))
            result = {}
            for name, llm in llms.items():
                metrics, _ = run_inprocess(llm, list(requests), args.concurrency)
                result[name] = (metrics.output_throughput, metrics.tpot.p50, metrics.ttft.p50)
                rows.append({"round": round_index, "workload": kind, "backend": name,
                             "output_tok_s": metrics.output_throughput,
                             "tpot_p50_ms": metrics.tpot.p50, "ttft_p50_ms": metrics.ttft.p50})
            (t_tps, t_tpot, t_ttft), (n_tps, n_tpot, n_ttft) = result["torch"], result["native"]
            print(f"round {round_index} {kind:6s} | torch {t_tps:6.1f} tok/s TPOT {t_tpot:6.1f} "
                  f"TTFT {t_ttft:7.0f} | native {n_tps:6.1f} tok/s TPOT {n_tpot:6.1f} "
                  f"TTFT {n_ttft:7.0f} | tok/s x{n_tps / t_tps:.2f}, TPOT x{n_tpot / t_tpot:.2f}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
