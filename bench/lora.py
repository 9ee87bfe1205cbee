"""Multi-LoRA throughput in process (issue 34): the base model alone vs 4 adapters mixed.

One offline LLM (the bundled model, the engine's default dtype, enable_lora with
max_loras 4) runs c16 random prompts (256 tokens in, 128 out, ignore_eos) in three arms,
in rotating order over --rounds after a warm-up round: every request on the base model;
every request on one adapter; requests spread round-robin over four adapters (each step
mixes them). The adapters are made here with peft (seeded random A and B on all seven
projections, rank --rank). Target: 4 adapters mixed >= 0.8x the base model's tok/s.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench lora [--rounds 3] [--rank 16] [--threads N] \\
        [--out docs/img/lora.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.inprocess_engine import make_llm, run_inprocess
from bench.serving.workload import load_prompt_maker
from conveyor.engine.native.cpu_features import cpu_features

MODEL = "smollm2-135m-instruct"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ARMS = ("base", "1 adapter", "4 adapters")


def make_adapter(folder: str, rank: int, seed: int,
                 targets: tuple[str, ...] = PROJECTIONS) -> str:
    """A PEFT LoRA adapter of the bundled model in `folder`, made with peft itself: seeded
    random, non-zero A and B (init_lora_weights=False), lora_alpha 2 x rank."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from conveyor.engine.model.loader import resolve_checkpoint

    base = LlamaForCausalLM.from_pretrained(resolve_checkpoint(MODEL), dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                        init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--threads", type=int, help="torch threads (default: the engine's)")
    parser.add_argument("--out", type=Path, help="also write the figures as a Markdown section")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    threads = {"torch_threads": args.threads} if args.threads else {}
    llm = make_llm(max_model_len=1024, enable_lora=True, max_loras=4, max_lora_rank=args.rank,
                   **threads)
    with tempfile.TemporaryDirectory() as scratch:
        adapters = [llm.core.loras.load(f"a{i}", make_adapter(f"{scratch}/a{i}", args.rank, i))
                    for i in range(4)]
    arms = {"base": [None], "1 adapter": adapters[:1], "4 adapters": adapters}
    requests = load_prompt_maker().random_requests(2 * args.concurrency, 256, 128, as_ids=True)
    samples: dict[str, list[float]] = {arm: [] for arm in ARMS}
    tpot: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for arm in ARMS[round_index % 3:] + ARMS[:round_index % 3]:
            metrics, _ = run_inprocess(llm, requests, args.concurrency, loras=arms[arm])
            if round_index:
                samples[arm].append(metrics.output_throughput)
                tpot[arm].append(metrics.tpot.mean)
    figures = {
        "concurrency": args.concurrency, "rank": args.rank, "rounds": args.rounds,
        "dtype": str(llm.core.runner.config.torch_dtype).removeprefix("torch."),
        "torch_threads": llm.settings.torch_threads, "cpu": cpu_features().describe(),
        "arms": {arm: {"tok_s": round(statistics.median(samples[arm]), 1),
                       "tpot_ms": round(statistics.median(tpot[arm]), 2),
                       "ratio": round(statistics.median(
                           a / b for a, b in zip(samples[arm], samples["base"], strict=True)), 3)}
                 for arm in ARMS},
        "load_average": [round(load_start, 1), round(os.getloadavg()[0], 1)]}
    print(json.dumps(figures, indent=1))
    if args.out:
        args.out.write_text(markdown(figures, " ".join(sys.argv[1:])))


def markdown(figures: dict, arguments: str) -> str:
    """The figures as docs/benchmarks.md's LoRA section."""
    rows = [f"| {arm} | {f['tok_s']} | {f['tpot_ms']} | {f['ratio']}x | "
            f"{'>= 0.8x' if arm == '4 adapters' else 'report'} |"
            for arm, f in figures["arms"].items()]
    return "\n".join([
        "## Multi-LoRA (issue 34)", "",
        f"`HF_HUB_OFFLINE=1 .venv/bin/python -m bench lora {arguments}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, in process (the bundled model, "
        f"{figures['dtype']}, greedy, {figures['torch_threads']} torch thread(s); CPU: "
        f"{figures['cpu']}): c{figures['concurrency']} random prompts, 256 tokens in and 128 "
        f"out, adapters of rank {figures['rank']} on all seven projections, max_loras 4; "
        f"{figures['rounds']} rounds with the arms in rotating order after a warm-up; load "
        f"average {figures['load_average'][0]} -> {figures['load_average'][1]}.", "",
        "| requests on | output tok/s | TPOT ms | vs base | target |",
        "|---|---|---|---|---|", *rows, "",
        "Ratios are medians of the rounds' ratios (each round ran every arm back to back).", ""])


if __name__ == "__main__":
    main()
