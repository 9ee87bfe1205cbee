"""Speculative decoding in process (issue 35): n-gram drafts, draft-model drafts and none.

One offline LLM (the bundled model, greedy, with a draft model: the same model in
--draft-weight-format); the arms differ only in who proposes drafts (switched between runs:
nobody, the scheduler's n-gram proposer, the runner's draft model), in rotating order over
--rounds after a warm-up round:
- c1 "copying": chat prompts whose answers copy from the prompt (a code edit, a quote, a
  JSON rewrite, a list to repeat): TPOT, and the drafts' acceptance;
- c1 "chat": ordinary chat questions: the same figures where little repeats;
- c16 "random": random prompts (ignore_eos): output tok/s, where speculation must back off
  (it speculates only while at most speculative_max_running requests run).

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench speculative [--k 4] [--rounds 5] \\
        [--max-tokens 128] [--draft-weight-format q4_1_int8] [--out docs/img/speculative.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.inprocess_engine import make_llm, run_inprocess
from bench.serving.workload import BenchRequest, load_prompt_maker
from conveyor.engine.native.cpu_features import cpu_features
from conveyor.engine.spec.ngram_proposer import NgramProposer

COPYING = [
    "Rename the variable x to total in this function and show the whole function:\n\n"
    "def add_all(values):\n    x = 0\n    for value in values:\n        x = x + value\n"
    "    return x\n",
    "Rewrite this JSON with every key in upper case: {\"name\": \"Ada Lovelace\", \"city\": "
    "\"London\", \"born\": 1815, \"fields\": [\"mathematics\", \"computing\"]}",
    "Quote the first sentence of this text exactly, then summarise it: The committee met on "
    "Tuesday to review the budget for the new library, and agreed to delay the vote until "
    "the next meeting. Several members asked for more detail on the costs.",
    "Repeat this list exactly: apples, oranges, pears, plums, grapes, cherries, lemons.",
    "Fix the typo in this sentence and write it out again: The quick brown fox jumpd over "
    "the lazy dog while the farmer watched from the barn.",
    "Add a docstring to this function and show the whole function:\n\n"
    "def area(width, height):\n    return width * height\n",
]
CHAT = ["What is the capital of France?", "Name three primary colors.",
        "Write a haiku about the sea.", "Tell me a fun fact about octopuses.",
        "How do I boil an egg?", "Why is the sky blue?"]


def chat_requests(llm, texts: list[str], max_tokens: int) -> list[BenchRequest]:
    tokenizer = llm.get_tokenizer()
    requests = []
    for text in texts:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                               tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        requests.append(BenchRequest(ids, len(ids), max_tokens))
    return requests


class DraftCounter:
    """Sums the drafts verified and accepted over the engine's steps while it is on."""

    def __init__(self, core) -> None:
        self.core = core
        self.num_draft_tokens = self.num_accepted_tokens = self.num_steps = 0

    def __enter__(self) -> DraftCounter:
        def counted(iteration):
            self.num_steps += 1
            self.num_draft_tokens += iteration.num_draft_tokens
            self.num_accepted_tokens += iteration.num_accepted_tokens
        self.core.timer.on_iteration = counted
        return self

    def __exit__(self, *exc) -> None:
        self.core.timer.on_iteration = None


ARMS = ("off", "ngram", "draft")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft-weight-format", default="q4_1_int8")
    parser.add_argument("--out", type=Path, help="also write the figures as a Markdown section")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    llm = make_llm(max_model_len=1024, num_speculative_tokens=args.k, speculative_method="draft",
                   speculative_draft_weight_format=args.draft_weight_format)
    scheduler = llm.core.scheduler
    ngram = NgramProposer(scheduler.config.ngram_min, scheduler.config.ngram_max)
    maker = load_prompt_maker()
    workloads = {
        "copying": (1, chat_requests(llm, COPYING, args.max_tokens), False),
        "chat": (1, chat_requests(llm, CHAT, args.max_tokens), False),
        "random": (16, maker.random_requests(32, 256, 64, as_ids=True), True),
    }
    figures: dict = {"k": args.k, "rounds": args.rounds, "max_tokens": args.max_tokens,
                     "draft_weight_format": args.draft_weight_format,
                     "speculative_max_running": scheduler.config.speculative_max_running,
                     "dtype": str(llm.core.runner.config.torch_dtype).removeprefix("torch."),
                     "torch_threads": llm.settings.torch_threads,
                     "cpu": cpu_features().describe()}
    for name, (concurrency, requests, ignore_eos) in workloads.items():
        samples: dict[str, dict[str, list[float]]] = {arm: {} for arm in ARMS}
        counts = {arm: {"draft": 0, "accepted": 0, "steps": 0} for arm in ARMS}
        for round_index in range(args.rounds + 1):  # round 0 warms up
            for arm in ARMS[round_index % 3:] + ARMS[:round_index % 3]:
                # off: no drafts; ngram: the scheduler proposes; draft: its proposer None,
                # the runner's draft model fills the slots the scheduler leaves.
                scheduler.config = dataclasses.replace(  # a benchmark's reach-in
                    scheduler.config, num_speculative_tokens=0 if arm == "off" else args.k)
                scheduler.proposer = ngram if arm == "ngram" else None
                with DraftCounter(llm.core) as counter:
                    metrics, _ = run_inprocess(llm, requests, concurrency, ignore_eos=ignore_eos)
                if round_index == 0:
                    continue
                for key, value in (("tpot_ms", metrics.tpot.mean),
                                   ("tok_s", metrics.output_throughput)):
                    samples[arm].setdefault(key, []).append(value)
                counts[arm]["steps"] += counter.num_steps
                counts[arm]["draft"] += counter.num_draft_tokens
                counts[arm]["accepted"] += counter.num_accepted_tokens
        figures[name] = summary(concurrency, samples, counts)
    figures["load_average"] = [round(load_start, 1), round(os.getloadavg()[0], 1)]
    print(json.dumps(figures, indent=1))
    if args.out:
        args.out.write_text(markdown(figures, " ".join(sys.argv[1:])))


def summary(concurrency: int, samples: dict, counts: dict) -> dict:
    """Per arm: medians over the rounds, the median of the rounds' ratios against "off"
    (TPOT: off / arm, so above 1 is better with drafts), acceptance and steps."""
    def median(arm, key):
        return round(statistics.median(samples[arm][key]), 2)

    def median_ratio(arm, key, better_low: bool):
        pairs = zip(samples["off"][key], samples[arm][key], strict=True)
        return round(statistics.median(a / b if better_low else b / a for a, b in pairs), 3)

    return {"concurrency": concurrency, "arms": {arm: {
        "tpot_ms": median(arm, "tpot_ms"), "tok_s": median(arm, "tok_s"),
        "tpot_gain": median_ratio(arm, "tpot_ms", True),
        "tok_s_ratio": median_ratio(arm, "tok_s", False),
        "acceptance": (round(counts[arm]["accepted"] / counts[arm]["draft"], 3)
                       if counts[arm]["draft"] else None),
        "steps": counts[arm]["steps"]} for arm in ARMS}}


def markdown(figures: dict, arguments: str) -> str:
    """The figures as docs/benchmarks.md's speculative-decoding section."""
    targets = {("copying", "ngram"): "TPOT >= 1.5x", ("random", "ngram"): "tok/s >= 0.95x",
               ("random", "draft"): "tok/s >= 0.95x"}
    rows = []
    for name in ("copying", "chat", "random"):
        f = figures[name]
        off = f["arms"]["off"]
        for arm in ("ngram", "draft"):
            a = f["arms"][arm]
            acceptance = "no drafts" if a["acceptance"] is None else f"{a['acceptance']:.0%}"
            rows.append(
                f"| c{f['concurrency']} {name} | {arm} | {off['tpot_ms']} / {a['tpot_ms']} | "
                f"{a['tpot_gain']}x | {off['tok_s']} / {a['tok_s']} | {a['tok_s_ratio']}x | "
                f"{acceptance} | {off['steps']} / {a['steps']} | "
                f"{targets.get((name, arm), 'report')} |")
    return "\n".join([
        "## Speculative decoding (issue 35)", "",
        f"`HF_HUB_OFFLINE=1 .venv/bin/python -m bench speculative {arguments}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, in process (the bundled model, "
        f"{figures['dtype']}, greedy, {figures['torch_threads']} torch thread(s): the engine's "
        f"default, the cores idle at start; CPU: {figures['cpu']}), k = {figures['k']} "
        f"drafts at most, speculation while at most {figures['speculative_max_running']} "
        "requests run. Arms: no drafts, n-gram drafts, drafts from the same model in "
        f"{figures['draft_weight_format']} (speculative_method draft); {figures['rounds']} "
        "rounds with the arms in rotating order after a warm-up; load average "
        f"{figures['load_average'][0]} -> {figures['load_average'][1]}.", "",
        "| workload | drafts | TPOT ms, off / with | TPOT gain | output tok/s, off / with | "
        "tok/s ratio | drafts accepted | steps, off / with | target |",
        "|---|---|---|---|---|---|---|---|---|", *rows, "",
        "Ratios are medians of the rounds' ratios (each round ran every arm back to back); "
        "greedy output is the same in every arm (tests/e2e/test_speculative_decoding.py), so "
        "the arms generate the same tokens.", ""])


if __name__ == "__main__":
    main()
