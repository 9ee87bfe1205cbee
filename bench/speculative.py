"""Speculative decoding in process (issue 35): n-gram drafts against none, same run.

One offline LLM (the bundled model, greedy); the arms differ only in whether the scheduler
proposes drafts (its proposer switched between rounds), alternating over --rounds after a
warm-up round:
- c1 "copying": chat prompts whose answers copy from the prompt (a code edit, a quote, a
  JSON rewrite, a list to repeat): TPOT, and the drafts' acceptance;
- c1 "chat": ordinary chat questions: the same figures where little repeats;
- c16 "random": random prompts (ignore_eos): output tok/s, where speculation must back off
  (it speculates only while at most speculative_max_running requests run).

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.speculative [--k 4] [--rounds 5] \\
        [--max-tokens 128] [--out docs/img/speculative.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.inprocess_engine import make_llm, run_inprocess
from bench.serving.workload import BenchRequest, load_prompt_maker
from conveyor.engine.native.cpu_features import cpu_features

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
        self.core, self._step = core, core.step
        self.num_draft_tokens = self.num_accepted_tokens = self.num_steps = 0

    def __enter__(self) -> DraftCounter:
        def counted():
            result = self._step()
            self.num_steps += 1
            self.num_draft_tokens += result.iteration.num_draft_tokens
            self.num_accepted_tokens += result.iteration.num_accepted_tokens
            return result
        self.core.step = counted
        return self

    def __exit__(self, *exc) -> None:
        self.core.step = self._step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, help="also write the figures as a Markdown section")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    llm = make_llm(max_model_len=1024, num_speculative_tokens=args.k)
    scheduler = llm.core.scheduler
    proposer = scheduler.proposer
    maker = load_prompt_maker()
    workloads = {
        "copying": (1, chat_requests(llm, COPYING, args.max_tokens), False),
        "chat": (1, chat_requests(llm, CHAT, args.max_tokens), False),
        "random": (16, maker.random_requests(32, 256, 64, as_ids=True), True),
    }
    figures: dict = {"k": args.k, "rounds": args.rounds, "max_tokens": args.max_tokens,
                     "speculative_max_running": scheduler.config.speculative_max_running,
                     "dtype": str(llm.core.runner.config.torch_dtype).removeprefix("torch."),
                     "torch_threads": llm.settings.torch_threads,
                     "cpu": cpu_features().describe()}
    for name, (concurrency, requests, ignore_eos) in workloads.items():
        samples: dict[str, dict[str, list[float]]] = {"off": {}, "ngram": {}}
        counts = {"draft": 0, "accepted": 0, "steps": {"off": 0, "ngram": 0}}
        for round_index in range(args.rounds + 1):  # round 0 warms up
            arms = ("off", "ngram") if round_index % 2 else ("ngram", "off")
            for arm in arms:
                scheduler.proposer = proposer if arm == "ngram" else None
                with DraftCounter(llm.core) as counter:
                    metrics, _ = run_inprocess(llm, requests, concurrency, ignore_eos=ignore_eos)
                if round_index == 0:
                    continue
                for key, value in (("tpot_ms", metrics.tpot.mean),
                                   ("tok_s", metrics.output_throughput)):
                    samples[arm].setdefault(key, []).append(value)
                counts["steps"][arm] += counter.num_steps
                counts["draft"] += counter.num_draft_tokens
                counts["accepted"] += counter.num_accepted_tokens
        figures[name] = summary(concurrency, samples, counts)
    scheduler.proposer = proposer
    figures["load_average"] = [round(load_start, 1), round(os.getloadavg()[0], 1)]
    print(json.dumps(figures, indent=1))
    if args.out:
        args.out.write_text(markdown(figures, " ".join(sys.argv[1:])))


def summary(concurrency: int, samples: dict, counts: dict) -> dict:
    """Medians over the rounds and the median of the rounds' ngram/off ratios (TPOT: off /
    ngram, so above 1 is better with drafts)."""
    def median(arm, key):
        return round(statistics.median(samples[arm][key]), 2)

    def median_ratio(key, better_low: bool):
        pairs = zip(samples["off"][key], samples["ngram"][key], strict=True)
        return round(statistics.median(a / b if better_low else b / a for a, b in pairs), 3)

    return {
        "concurrency": concurrency,
        "tpot_ms": {arm: median(arm, "tpot_ms") for arm in samples},
        "tok_s": {arm: median(arm, "tok_s") for arm in samples},
        "tpot_gain": median_ratio("tpot_ms", True),
        "tok_s_ratio": median_ratio("tok_s", False),
        "acceptance": round(counts["accepted"] / counts["draft"], 3) if counts["draft"] else None,
        "steps": counts["steps"],
    }


def markdown(figures: dict, arguments: str) -> str:
    """The figures as docs/benchmarks.md's speculative-decoding section."""
    rows = []
    targets = {"copying": "TPOT >= 1.5x", "chat": "report", "random": "tok/s >= 0.95x"}
    for name in ("copying", "chat", "random"):
        f = figures[name]
        acceptance = "no drafts" if f["acceptance"] is None else f"{f['acceptance']:.0%}"
        rows.append(
            f"| c{f['concurrency']} {name} | {f['tpot_ms']['off']} / {f['tpot_ms']['ngram']} | "
            f"{f['tpot_gain']}x | {f['tok_s']['off']} / {f['tok_s']['ngram']} | "
            f"{f['tok_s_ratio']}x | {acceptance} | {f['steps']['off']} / {f['steps']['ngram']} "
            f"| {targets[name]} |")
    return "\n".join([
        "## Speculative decoding, n-gram drafts (issue 35)", "",
        f"`HF_HUB_OFFLINE=1 .venv/bin/python -m bench.speculative {arguments}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, in process (the bundled model, "
        f"{figures['dtype']}, greedy, {figures['torch_threads']} torch thread(s): the engine's "
        f"default, the cores idle at start; CPU: {figures['cpu']}), k = {figures['k']} "
        f"drafts at most, speculation while at most {figures['speculative_max_running']} "
        f"requests run; {figures['rounds']} rounds with the arms alternating after a warm-up; "
        f"load average {figures['load_average'][0]} -> {figures['load_average'][1]}.", "",
        "| workload | TPOT ms, off / n-gram | TPOT gain | output tok/s, off / n-gram | "
        "tok/s ratio | drafts accepted | steps, off / n-gram | target |",
        "|---|---|---|---|---|---|---|---|", *rows, "",
        "Ratios are medians of the rounds' ratios (each round ran both arms back to back); "
        "greedy output is the same in both arms (tests/e2e/test_speculative_decoding.py), so "
        "the arms generate the same tokens.", ""])


if __name__ == "__main__":
    main()
