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

import dataclasses
import functools
from collections import Counter

from bench import arms
from bench.inprocess_engine import make_llm, run_inprocess
from bench.serving.workload import load_prompt_maker
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
ARMS = ("off", "ngram", "draft")
TARGETS = {("copying", "ngram"): "TPOT >= 1.5x", ("random", "ngram"): "tok/s >= 0.95x",
           ("random", "draft"): "tok/s >= 0.95x"}


def main() -> None:
    parser = arms.parser(__doc__, rounds=5)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft-weight-format", default="q4_1_int8")
    args = parser.parse_args()
    header = arms.Header("speculative")
    llm = make_llm(max_model_len=1024, num_speculative_tokens=args.k, speculative_method="draft",
                   speculative_draft_weight_format=args.draft_weight_format)
    scheduler = llm.core.scheduler
    ngram = NgramProposer(scheduler.config.ngram_min, scheduler.config.ngram_max)
    counts = Counter()  # the drafts verified and accepted over the engine's steps
    llm.core.timer.on_iteration = lambda step: counts.update(
        steps=1, draft=step.num_draft_tokens, accepted=step.num_accepted_tokens)
    figures = {"k": args.k, "rounds": args.rounds, "max_tokens": args.max_tokens,
               "draft_weight_format": args.draft_weight_format,
               "speculative_max_running": scheduler.config.speculative_max_running}
    workloads = {  # name: (concurrency, requests, ignore_eos)
        "copying": (1, arms.chat_requests(llm, COPYING, args.max_tokens), False),
        "chat": (1, arms.chat_requests(llm, CHAT, args.max_tokens), False),
        "random": (16, load_prompt_maker().random_requests(32, 256, 64, as_ids=True), True),
    }

    def measure(concurrency: int, requests: list, ignore_eos: bool, arm: str) -> arms.Sample:
        # off: no drafts; ngram: the scheduler proposes; draft: its proposer None,
        # the runner's draft model fills the slots the scheduler leaves.
        scheduler.config = dataclasses.replace(  # a benchmark's reach-in
            scheduler.config, num_speculative_tokens=0 if arm == "off" else args.k)
        scheduler.proposer = ngram if arm == "ngram" else None
        counts.clear()
        metrics, _ = run_inprocess(llm, requests, concurrency, ignore_eos=ignore_eos)
        return {"tpot_ms": metrics.tpot.mean, "tok_s": metrics.output_throughput, **counts}

    for name, workload in workloads.items():
        rounds = arms.run_rounds(ARMS, args.rounds, functools.partial(measure, *workload), name)
        figures[name] = summary(workload[0], rounds)
    arms.publish({**header.figures(llm), **figures}, args.out, markdown)


def summary(concurrency: int, rounds: arms.Rounds) -> dict:
    """Per arm: medians and ratios to "off", TPOT's as a gain (off / arm: above 1 is better
    with drafts), the share of drafts accepted and the steps taken over the rounds."""
    def acceptance(arm):
        draft = rounds.total(arm, "draft")
        return round(rounds.total(arm, "accepted") / draft, 3) if draft else None

    return {"concurrency": concurrency, "arms": {
        arm: {**figures, "tpot_gain": rounds.ratio("off", arm, "tpot_ms"),
              "acceptance": acceptance(arm), "steps": rounds.total(arm, "steps")}
        for arm, figures in rounds.summary("off", "tpot_ms", "tok_s").items()}}


def markdown(figures: dict) -> str:
    """The figures as docs/benchmarks.md's speculative-decoding section."""
    rows = []
    for name in ("copying", "chat", "random"):
        off = figures[name]["arms"]["off"]
        for arm in ("ngram", "draft"):
            a = figures[name]["arms"][arm]
            rows.append([
                f"c{figures[name]['concurrency']} {name}", arm,
                f"{off['tpot_ms']} / {a['tpot_ms']}", f"{a['tpot_gain']}x",
                f"{off['tok_s']} / {a['tok_s']}", f"{a['tok_s_ratio']}x",
                "no drafts" if a["acceptance"] is None else f"{a['acceptance']:.0%}",
                f"{off['steps']} / {a['steps']}", TARGETS.get((name, arm), "report")])
    return arms.section(
        "## Speculative decoding (issue 35)", figures,
        f"k = {figures['k']} drafts at most, speculation while at most "
        f"{figures['speculative_max_running']} requests run; arms: no drafts, n-gram drafts, "
        f"drafts from the same model in {figures['draft_weight_format']} (speculative_method "
        "draft)",
        ["workload", "drafts", "TPOT ms, off / with", "TPOT gain", "output tok/s, off / with",
         "tok/s ratio", "drafts accepted", "steps, off / with", "target"], rows,
        "Greedy output is the same in every arm (tests/e2e/test_speculative_decoding.py), so "
        "the arms generate the same tokens.")


if __name__ == "__main__":
    main()
