"""Engine micro-benchmark: the offline engine on issue 7's workloads, optionally A/B.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.engine_step_bench [--hf] [--threads N]
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.engine_step_bench --against /tmp/base --rounds 3

Workloads (random token prompts, greedy, ignore_eos):
  conc-N   N prompts of 256 tokens, 64 output tokens each, in one `generate` call:
           output tok/s, and model GFLOP/s over prompt + output tokens (bench.roofline's
           definition: 2 x linear parameters x tokens/s).
  single   one 256-token prompt, 64 output tokens: decode tok/s after the first token.
  prefix   TTFT of a 1,000-token system prompt + a short question, cold then warm.
With --steps, instead: the median time of single engine steps (decode steps at each
concurrency with 256-token contexts, and prefill steps of 8 x 256 tokens), the
quickest A/B signal for a change inside a step.
With --hf the same conc-N and single workloads run through transformers `generate`
(static batching, same dtype and threads) in the same process; --dtype sets both.

--against DIR runs this script alternately against DIR's services/engine (a checkout of
the baseline, e.g. `git worktree add /tmp/base HEAD~1`) and this tree, --rounds times,
in fresh processes, and prints the candidate/baseline ratio per workload per round:
the machine is shared, so only side-by-side ratios mean much.

--variant NAME=SETTINGS (repeated) runs the peer suite's profile in process instead, one fresh
process per variant, the variants alternating (their order reversed every other round),
--rounds times: c1 (--c1-requests requests one at a time: TTFT and TPOT p50) and c16
(--c16-requests at concurrency 16: output tok/s and TTFT p50), 256-token random prompts, 64
output tokens, ignore_eos. SETTINGS is KEY=VALUE pairs, comma-separated, set in the child's
environment (CONVEYOR_ENGINE_DTYPE=bfloat16, a kernel switch, ...); the key `tree` runs the
engine of another checkout (its services/engine first on PYTHONPATH), e.g.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.engine_step_bench --threads 2 --rounds 3 \
        --variant fp32=CONVEYOR_ENGINE_DTYPE=float32 \
        --variant bf16-before=tree=/tmp/base,CONVEYOR_ENGINE_DTYPE=bfloat16 \
        --variant bf16=CONVEYOR_ENGINE_DTYPE=bfloat16
Each round prints every variant's figures and the machine's load; the summary gives each
figure's median over the rounds and its ratio to the first variant's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

PROMPT_LEN, OUTPUT_LEN, SYSTEM_LEN = 256, 64, 1000


def random_prompts(count: int, length: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def conveyor_generate(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from conveyor.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def conveyor_decode_tps(llm, prompt: list[int], max_tokens: int) -> float:
    """Single stream: tokens/s after the first token (the prefill step excluded)."""
    from conveyor.engine.engine_request import EngineRequest
    from conveyor.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.core.add_request(EngineRequest("single", list(prompt), params))
    times = []
    while llm.core.has_unfinished_requests:
        if llm.core.step():
            times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def conveyor_ttft(llm, prompt: list[int]) -> float:
    return conveyor_generate(llm, [prompt], 1)


def hf_generate(model, prompts: list[list[int]], max_tokens: int) -> float:
    import torch

    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)
    return time.perf_counter() - start


def hf_decode_tps(model, prompt: list[int], max_tokens: int) -> float:
    prefill = hf_generate(model, [prompt], 1)
    total = hf_generate(model, [prompt], max_tokens)
    return (max_tokens - 1) / (total - prefill)


def run_conveyor(args, results: dict) -> None:
    from bench.roofline import load_model_config, model_flops
    from conveyor.engine import LLM

    config = load_model_config(args.model)
    llm = LLM(args.model, max_num_seqs=max(args.concurrency), kv_cache_gib=args.kv_cache_gib,
              max_model_len=2048, torch_threads=args.threads, dtype=args.dtype)
    conveyor_generate(llm, random_prompts(2, 32, seed=-1), 4)
    for n in args.concurrency:
        seconds = conveyor_generate(llm, random_prompts(n, PROMPT_LEN, seed=n), OUTPUT_LEN)
        results[f"conc-{n} tok/s"] = n * OUTPUT_LEN / seconds
        tokens_per_s = n * (PROMPT_LEN + OUTPUT_LEN) / seconds
        results[f"conc-{n} GFLOP/s"] = model_flops(config, tokens_per_s) / 1e9
    results["single decode tok/s"] = conveyor_decode_tps(
        llm, random_prompts(1, PROMPT_LEN, seed=7)[0], OUTPUT_LEN)
    system = random_prompts(1, SYSTEM_LEN, seed=11)[0]
    question = random_prompts(2, 24, seed=12)
    cold = conveyor_ttft(llm, system + question[0])
    warm = conveyor_ttft(llm, system + question[1])
    results["prefix cold/warm TTFT"] = cold / warm


def time_steps(llm, count: int) -> float:
    """Median ms of `count` engine steps."""
    import statistics

    times = []
    for _ in range(count):
        start = time.perf_counter()
        llm.core.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run_steps(args, results: dict) -> None:
    from conveyor.engine import LLM
    from conveyor.engine.engine_request import EngineRequest
    from conveyor.engine.sampling_params import SamplingParams

    llm = LLM(args.model, max_num_seqs=max(args.concurrency), kv_cache_gib=args.kv_cache_gib,
              max_model_len=2048, torch_threads=args.threads, dtype=args.dtype)
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    for n in [1, *args.concurrency]:
        for i, prompt in enumerate(random_prompts(n, PROMPT_LEN, seed=n)):
            llm.core.add_request(EngineRequest(f"s{n}-{i}", prompt, params))
        prefill = time_steps(llm, -(-n * PROMPT_LEN // 2048))
        if n >= 8:
            results["prefill-2048 steps/s"] = 1e3 / prefill
        time_steps(llm, 2)
        results[f"decode-{n} step/s"] = 1e3 / time_steps(llm, args.num_steps)
        llm.core.abort(llm.core.unfinished_request_ids)
        llm.core.step()


def run_hf(args, results: dict) -> None:
    import torch

    from bench.baselines.hf_model import load_hf_model

    model, _ = load_hf_model(args.model, dtype=getattr(torch, args.dtype))
    hf_generate(model, random_prompts(2, 32, seed=-1), 4)
    for n in args.concurrency:
        seconds = hf_generate(model, random_prompts(n, PROMPT_LEN, seed=n), OUTPUT_LEN)
        results[f"hf conc-{n} tok/s"] = n * OUTPUT_LEN / seconds
    results["hf single decode tok/s"] = hf_decode_tps(
        model, random_prompts(1, PROMPT_LEN, seed=7)[0], OUTPUT_LEN)


def run_peer_profile(args, results: dict) -> None:
    """c1 TTFT/TPOT p50 and c16 tok/s and TTFT p50 of the offline engine (settings from the
    environment), driven in a closed loop like the served benchmark."""
    from bench.inprocess_engine import make_llm, run_inprocess
    from bench.serving.workload import BenchRequest

    llm = make_llm(model=args.model, max_num_seqs=64, kv_cache_gib=args.kv_cache_gib,
                   max_model_len=2048, torch_threads=args.threads)

    def requests(count: int, seed: int) -> list[BenchRequest]:
        return [BenchRequest(p, PROMPT_LEN, OUTPUT_LEN)
                for p in random_prompts(count, PROMPT_LEN, seed=seed)]

    run_inprocess(llm, requests(2, seed=-1), 2)  # warm-up: oneDNN primitives, first calls
    c1, _ = run_inprocess(llm, requests(args.c1_requests, seed=1), 1)
    c16, _ = run_inprocess(llm, requests(args.c16_requests, seed=16), 16)
    results.update({"c1 TTFT ms": c1.ttft.p50, "c1 TPOT ms": c1.tpot.p50,
                    "c16 tok/s": c16.output_throughput, "c16 TTFT ms": c16.ttft.p50,
                    "dtype": llm.core.info.dtype, "attention": llm.core.info.attention_backend})


def run_once(args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict = {"threads": torch.get_num_threads()}
    if args.steps:
        run_steps(args, results)
        return results
    if args.peer_profile:
        run_peer_profile(args, results)
        return results
    run_conveyor(args, results)
    if args.hf:
        run_hf(args, results)
        for n in args.concurrency:
            results[f"ratio conc-{n}"] = results[f"conc-{n} tok/s"] / results[f"hf conc-{n} tok/s"]
        results["ratio single"] = (results["single decode tok/s"]
                                   / results["hf single decode tok/s"])
    return results


def compare(args, argv: list[str]) -> None:
    """Alternate baseline and candidate in fresh processes; print candidate/baseline."""
    here = Path(__file__).resolve().parents[1]
    child = [a for a in argv if a not in ("--against", args.against)]
    child = [a for i, a in enumerate(child)
             if a != "--rounds" and (i == 0 or child[i - 1] != "--rounds")]
    for round_ in range(args.rounds):
        runs = {}
        for label, tree in (("base", Path(args.against)), ("cand", here)):
            env = dict(os.environ, PYTHONPATH=f"{tree / 'services/engine'}:{here}")
            out = subprocess.run([sys.executable, "-m", "bench.engine_step_bench", "--json",
                                  *child], env=env, cwd=here, capture_output=True, text=True,
                                 check=True).stdout
            runs[label] = json.loads(out.strip().splitlines()[-1])
        ratios = {k: runs["cand"][k] / runs["base"][k] for k in runs["cand"]
                  if isinstance(runs["cand"][k], float)}
        print(f"round {round_}: " + "  ".join(f"{k} {v:.2f}x" for k, v in ratios.items()),
              flush=True)
        print(f"  base {runs['base']}\n  cand {runs['cand']}", flush=True)


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """NAME=K1=V1,K2=V2 -> (NAME, {K1: V1, K2: V2}); `tree` is the engine checkout."""
    name, _, settings = spec.partition("=")
    return name, dict(kv.split("=", 1) for kv in settings.split(",") if kv)


def compare_variants(args, argv: list[str]) -> None:
    """The peer profile of each variant in fresh processes, alternating, --rounds times."""
    import statistics

    here = Path(__file__).resolve().parents[1]
    variants = dict(parse_variant(spec) for spec in args.variant)
    child = ["--json", "--peer-profile", "--threads", str(args.threads), "--c1-requests",
             str(args.c1_requests), "--c16-requests", str(args.c16_requests)]
    rows: dict[str, list[dict]] = {name: [] for name in variants}
    for round_ in range(args.rounds):
        order = list(variants.items())
        for name, settings in order if round_ % 2 == 0 else reversed(order):
            env = {k: v for k, v in settings.items() if k != "tree"}
            tree = Path(settings.get("tree", here))
            env = dict(os.environ, **env, PYTHONPATH=f"{tree / 'services/engine'}:{here}")
            load = os.getloadavg()[0]
            out = subprocess.run([sys.executable, "-m", "bench.engine_step_bench", *child],
                                 env=env, cwd=here, capture_output=True, text=True,
                                 check=True).stdout
            rows[name].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {round_} {name:14s} load {load:4.2f} " + "  ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in rows[name][-1].items()), flush=True)
    first = next(iter(variants))
    figures = [k for k, v in rows[first][0].items() if isinstance(v, float)]
    print("| variant | " + " | ".join(figures) + " |")
    print("|---|" + "---:|" * len(figures))
    for name, runs in rows.items():
        cells = []
        for k in figures:
            median = statistics.median(r[k] for r in runs)
            base = statistics.median(r[k] for r in rows[first])
            cells.append(f"{median:.1f} ({median / base:.2f}x)")
        print(f"| {name} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--concurrency", default=[16, 32],
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--dtype", default="float32", help="both sides' dtype (float32, bfloat16)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--hf", action="store_true", help="also run transformers generate")
    p.add_argument("--against", default=None, help="baseline tree for an A/B run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", action="store_true", help="time single steps (see above)")
    p.add_argument("--num-steps", type=int, default=9)
    p.add_argument("--json", action="store_true", help="print one JSON line (for --against)")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=KEY=VALUE,... (repeated): the peer profile per variant (above)")
    p.add_argument("--peer-profile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--c1-requests", type=int, default=6)
    p.add_argument("--c16-requests", type=int, default=48)
    args = p.parse_args(argv)
    if args.variant:
        compare_variants(args, argv)
        return 0
    if args.against:
        compare(args, argv)
        return 0
    results = run_once(args)
    print(json.dumps(results) if args.json else
          "\n".join(f"{k:28s} {v:10.2f}" for k, v in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
