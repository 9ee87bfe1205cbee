"""Benchmark any OpenAI-compatible server from the command line.

    .venv/bin/python -m bench.serving --base-url http://127.0.0.1:8000 \\
        --dataset random --input-len 256 --output-len 64 --num-prompts 64 --max-concurrency 16
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from bench.serving.metrics import Slo, format_metrics
from bench.serving.runner import RunConfig, run
from bench.serving.workload import BenchRequest, load_prompt_maker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="model name sent to the server and whose tokenizer builds the prompts")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=("random", "fixed", "shared-prefix"), default="random")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (question tokens "
                   "for shared-prefix)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--prefix-len", type=int, default=1000, help="shared-prefix: system prompt")
    p.add_argument("--token-ids", action="store_true", help="send prompts as token id lists")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson rate, req/s")
    p.add_argument("--duration", type=float, default=None, help="stop issuing after N seconds")
    p.add_argument("--no-ignore-eos", action="store_true")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2el-ms", type=float, default=None)
    p.add_argument("--num-warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return p.parse_args(argv)


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    maker = load_prompt_maker(args.model, args.seed)
    if args.dataset == "fixed":
        return maker.fixed_requests(args.num_prompts, args.input_len, args.output_len,
                                    args.token_ids)
    if args.dataset == "shared-prefix":
        return maker.shared_prefix_requests(args.num_prompts, args.prefix_len, args.input_len,
                                            args.output_len, args.token_ids)
    return maker.random_requests(args.num_prompts, args.input_len, args.output_len,
                                 args.range_ratio, args.token_ids)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    slo = None
    if any(v is not None for v in (args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms)):
        slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms)
    config = RunConfig(base_url=args.base_url, model=args.model,
                       max_concurrency=args.max_concurrency, request_rate=args.request_rate,
                       duration_s=args.duration, ignore_eos=not args.no_ignore_eos, slo=slo,
                       num_warmup=args.num_warmup, api_key=args.api_key, seed=args.seed)
    metrics, _ = run(build_requests(args), config)
    print(format_metrics(args.dataset, metrics))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(metrics.as_dict(), f, indent=2)
    return 0 if metrics.completed else 1


if __name__ == "__main__":
    sys.exit(main())
