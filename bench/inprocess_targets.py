"""Issue 19's in-process targets, measured in one run at one thread count.

1. Read bandwidth: the best `x.sum()` over a tensor the size of the weights (far beyond
   the L3), at the engine's thread count -- the DRAM floor of a one-row step is the
   weight bytes it reads (every linear layer, lm_head included) over this bandwidth.
   Readings alternate with single-stream requests (3.), each TPOT held to its neighbour.
2. The practical roofline: bench/kernels/roofline.py's best forward pass (all linear layers at
   M rows, the best of the kernels torch offers here) over M in --roofline-tokens; and the
   FMA peak with every thread running at once (bench/kernels/fma_peak.py), the ceiling no kernel
   passes, which the last rounds proposed as the yardstick (the best forward pass is no
   ceiling once the engine's own kernels beat oneDNN's).
3. The offline engine (no other services), driven in a closed loop (bench/inprocess_engine.py):
   concurrency 1 (TPOT p50) and concurrency 64 (model FLOP/s over the whole run).

Model FLOPs count each token's linear layers (2 x parameters), and lm_head only for the
tokens that are sampled (every output token; of a prompt, only its last) -- the roofline's
forward runs lm_head on every row, as a decode step does.

Prints the two ratios (TPOT / floor, target <= 1.15; achieved / roofline, target >= 0.80)
and writes them, with every input figure, as JSON (default docs/img/inprocess_targets.json,
which bench/run_suite.py's peer report reads).

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench inprocess-targets [--threads 2] [--quick]
        [--kv-cache-dtype float16 --json docs/img/inprocess_targets_kv16.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench.kernels import fma_peak, roofline

DEFAULT_JSON = Path(__file__).resolve().parents[1] / "docs" / "img" / "inprocess_targets.json"
DRAM_FLOOR_SLACK = 1.15
ROOFLINE_SHARE = 0.80
PROMPT_LEN, OUTPUT_LEN = 256, 64


def read_bandwidth_gb_s(x: torch.Tensor, repeats: int = 5) -> float:
    """Best GB/s of `x.sum()` over a float32 tensor far beyond the caches (one pass first)."""
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def lm_head_params(config: dict) -> int:
    return config["vocab_size"] * config["hidden_size"]


def run_flops(config: dict, prompt_tokens: int, output_tokens: int) -> float:
    """Model FLOPs of a run: linear layers for every token, lm_head for sampled ones."""
    body = roofline.params_per_token(config) - lm_head_params(config)
    # A prompt's last token is the one that samples the first output token.
    return 2.0 * (body * (prompt_tokens + output_tokens) + lm_head_params(config) * output_tokens)


def engine_run(llm, concurrency: int, num_requests: int, seed: int = 0) -> dict:
    """Closed loop at `concurrency` over random-token prompts; metrics as a dict."""
    from bench.inprocess_engine import run_inprocess
    from bench.serving.workload import load_prompt_maker

    maker = load_prompt_maker(seed=1000 * concurrency + seed)
    requests = maker.random_requests(num_requests, PROMPT_LEN, OUTPUT_LEN, as_ids=True)
    metrics, _ = run_inprocess(llm, requests, concurrency)
    return metrics.as_dict()


def single_stream_vs_floor(llm, weight_bytes: int, num_pairs: int) -> dict:
    """Alternate a bandwidth reading and one single-stream request, `num_pairs` times: the
    machine is shared, so each TPOT is held to the floor measured next to it; the medians
    of TPOT, floor and their ratio are reported."""
    import statistics

    x = torch.ones(weight_bytes // 4)
    pairs = []
    for i in range(num_pairs):
        bandwidth = read_bandwidth_gb_s(x)
        metrics = engine_run(llm, 1, 1, seed=i)
        floor_ms = weight_bytes / (bandwidth * 1e9) * 1e3
        pairs.append((metrics["p50_tpot_ms"], floor_ms, bandwidth))
    median = lambda k: statistics.median(p[k] for p in pairs)  # noqa: E731
    return {"tpot_c1_ms": median(0), "dram_floor_ms": median(1), "read_bandwidth_gb_s": median(2),
            "dram_floor_ratio": statistics.median(t / f for t, f, _ in pairs),
            "c1_pairs": [{"tpot_ms": t, "floor_ms": f, "bandwidth_gb_s": b} for t, f, b in pairs]}


def measure(args) -> dict:
    from bench.inprocess_engine import make_llm

    torch.set_num_threads(args.threads)
    config = roofline.load_model_config(args.model)
    weight_bytes = roofline.params_per_token(config) * 4
    out: dict = {"threads": args.threads, "dtype": "float32", "weight_bytes": weight_bytes,
                 "kv_cache_dtype": args.kv_cache_dtype}
    llm = make_llm(model=args.model, max_num_seqs=64, kv_cache_gib=2.0, max_model_len=2048,
                   torch_threads=args.threads, dtype="float32",
                   kv_cache_dtype=args.kv_cache_dtype)
    engine_run(llm, 2, 2)  # warm-up: first-call allocations, oneDNN primitives
    out.update(single_stream_vs_floor(llm, weight_bytes, args.c1_requests))
    roof = roofline.run_roofline(config, ["float32"], args.roofline_tokens,
                                 0.1 if args.quick else 0.3)
    out["roofline_gflops"] = roofline.best_forward_gflops(roof)
    out["roofline_forward"] = roof["forward"]
    out["peak_square_gflops"] = roof["peak"]["float32"]
    out["fma_peak_gflops"] = fma_peak.fma_peak_gflops(args.threads)
    c64 = engine_run(llm, 64, args.c64_requests)
    flops = run_flops(config, c64["total_input_tokens"], c64["total_output_tokens"])
    out["achieved_gflops_c64"] = flops / c64["duration_s"] / 1e9
    out["c64"] = c64
    out["roofline_share"] = out["achieved_gflops_c64"] / out["roofline_gflops"]
    out["fma_peak_share"] = out["achieved_gflops_c64"] / out["fma_peak_gflops"]
    return out


def format_targets(r: dict) -> str:
    floor_ok = "met" if r["dram_floor_ratio"] <= DRAM_FLOOR_SLACK else "not met"
    roof_ok = "met" if r["roofline_share"] >= ROOFLINE_SHARE else "not met"
    return "\n".join([
        f"threads {r['threads']}, {r['dtype']}, KV pool {r.get('kv_cache_dtype', 'auto')}; "
        f"weights read per one-row step "
        f"{r['weight_bytes'] / 1e6:.0f} MB",
        f"read bandwidth {r['read_bandwidth_gb_s']:.1f} GB/s -> DRAM floor "
        f"{r['dram_floor_ms']:.1f} ms per step",
        f"c1 TPOT p50 {r['tpot_c1_ms']:.1f} ms; median TPOT / floor over "
        f"{len(r['c1_pairs'])} pairs {r['dram_floor_ratio']:.2f}x "
        f"(target <= {DRAM_FLOOR_SLACK:.2f}x): {floor_ok}",
        f"practical roofline {r['roofline_gflops']:.1f} GFLOP/s (square matmul peak "
        f"{r['peak_square_gflops']:.1f})",
        f"c64 model FLOP/s {r['achieved_gflops_c64']:.1f} = {r['roofline_share']:.0%} of the "
        f"roofline (target >= {ROOFLINE_SHARE:.0%}): {roof_ok}; c64 output "
        f"{r['c64']['output_throughput']:.1f} tok/s",
        *([f"FMA peak of {r['threads']} threads at once {r['fma_peak_gflops']:.1f} GFLOP/s: "
           f"c64 at {r['fma_peak_share']:.0%} of it"] if r.get("fma_peak_gflops") else []),
    ])


def tree_state() -> str:
    """The commit measured, and the engine files changed on top of it (if any)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]

    def run(*cmd: str) -> str:
        return subprocess.run(cmd, cwd=root, capture_output=True, text=True).stdout

    changed = run("git", "status", "--porcelain", "--", "services/engine/conveyor").split()
    commit = run("git", "rev-parse", "--short", "HEAD").strip()
    return commit + (f" + uncommitted {' '.join(changed[1::2])}" if changed else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=roofline.engine_threads() or 2)
    p.add_argument("--roofline-tokens", default=roofline.BATCH_TOKENS,
                   type=lambda s: tuple(int(x) for x in s.split(",")))
    p.add_argument("--c1-requests", type=int, default=5,
                   help="single-stream requests, each next to a bandwidth reading")
    p.add_argument("--c64-requests", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="shorter timings, 64 requests at c64")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float16"],
                   help="the engine's KV pool (CONVEYOR_ENGINE_KV_CACHE_DTYPE)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)
    if args.quick:
        args.c64_requests = min(args.c64_requests, 64)
    result = measure(args)
    print(format_targets(result))
    result["command"] = "python -m bench inprocess-targets " + " ".join(argv or sys.argv[1:])
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result["tree"] = tree_state()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
