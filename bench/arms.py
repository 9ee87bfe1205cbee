"""The skeleton of the in-process feature benchmarks (structured outputs, speculative
decoding, LoRA): named arms on one engine, a warm-up round, then rounds in rotating
order (A B C, B C A, C A B: a machine that drifts favours no arm); medians, the median of the
rounds' ratios between two arms (run back to back: the least noisy comparison); the section.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm import tqdm

from bench.serving.workload import BenchRequest

Sample = dict[str, float]
"""What one run of an arm measured, by figure name."""


def rotated(arms: Sequence[str], round_index: int) -> list[str]:
    shift = round_index % len(arms)
    return [*arms[shift:], *arms[:shift]]


class Rounds:
    """Each arm's samples, one a round in round order (the warm-up round not kept)."""

    def __init__(self, samples: dict[str, list[Sample]]) -> None:
        self.samples = samples

    def median(self, arm: str, figure: str, digits: int = 2) -> float:
        return round(statistics.median(s[figure] for s in self.samples[arm]), digits)

    def ratio(self, arm: str, base: str, figure: str) -> float:
        """The median over rounds of `arm`'s figure / `base`'s in the same round."""
        pairs = zip(self.samples[arm], self.samples[base], strict=True)
        return round(statistics.median(a[figure] / b[figure] for a, b in pairs), 3)

    def total(self, arm: str, figure: str) -> float:
        return sum(s[figure] for s in self.samples[arm])

    def summary(self, base: str, *figures: str) -> dict[str, dict[str, float]]:
        """Per arm: each figure's median, and (FIGURE_ratio) its ratio to `base`'s."""
        return {arm: {f: self.median(arm, f) for f in figures}
                | {f"{f}_ratio": self.ratio(arm, base, f) for f in figures}
                for arm in self.samples}


def run_rounds(arms: Sequence[str], rounds: int, measure: Callable[[str], Sample],
               desc: str = "", warmup: bool = True) -> Rounds:
    """`measure(arm)` for every arm in a warm-up round (unless `warmup` is off: the A/B
    runner's fresh processes have nothing to warm) and then `rounds` rounds, in rotating order,
    with a progress bar on stderr and each kept sample written above it."""
    samples: dict[str, list[Sample]] = {arm: [] for arm in arms}
    skip = 1 if warmup else 0
    with tqdm(total=(rounds + skip) * len(arms), desc=desc, unit="run", file=sys.stderr) as bar:
        for index in range(rounds + skip):
            for arm in rotated(arms, index):
                bar.set_postfix_str(f"round {index + 1 - skip}/{rounds} {arm}")
                sample = measure(arm)
                if index >= skip:
                    samples[arm].append(sample)
                    bar.write(f"round {index + 1 - skip} {arm}: " + "  ".join(
                        f"{k} {v:.3g}" for k, v in sample.items() if isinstance(v, float)),
                        file=sys.stderr)  # stdout holds the figures alone (JSON)
                bar.update()
    return Rounds(samples)


def chat_requests(llm, texts: list[str], max_tokens: int) -> list[BenchRequest]:
    """Each text as one user turn in the model's chat template, as token ids."""
    template = llm.get_tokenizer().apply_chat_template
    ids = [template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]
           for text in texts]
    return [BenchRequest(prompt, len(prompt), max_tokens) for prompt in ids]


def parser(doc: str, rounds: int) -> argparse.ArgumentParser:
    """The benchmark's options, --rounds and --out among them."""
    options = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    options.add_argument("--rounds", type=int, default=rounds)
    options.add_argument("--out", type=Path, help="also write the figures as a Markdown "
                         "section (docs/img/NAME.md: the suite's report includes it)")
    return options


class Header:
    """What a section opens with: the command line, date and load average when the benchmark
    starts; the engine's dtype and threads, the CPU and the load average when it ends."""

    def __init__(self, command: str) -> None:
        self.command = " ".join(["HF_HUB_OFFLINE=1 .venv/bin/python -m bench", command,
                                 *sys.argv[1:]])
        self.date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        self.load_start = os.getloadavg()[0]

    def figures(self, llm) -> dict:
        from conveyor.engine.native.cpu_features import cpu_features

        return {"command": self.command, "date": self.date,
                "dtype": str(llm.core.runner.config.torch_dtype).removeprefix("torch."),
                "torch_threads": llm.settings.torch_threads, "cpu": cpu_features().describe(),
                "num_cpus": os.cpu_count(),
                "load_average": [round(self.load_start, 1), round(os.getloadavg()[0], 1)]}


def section(heading: str, figures: dict, setup: str, columns: list[str], rows: list[list],
            note: str = "") -> str:
    """A Markdown section: how it ran (Header's figures, --rounds, then `setup`), a table
    (`columns`, then a line of cells per row), then `note`."""
    load = figures["load_average"]
    opening = (
        f"`{figures['command']}` on {figures['date']}, in process (the bundled model, "
        f"{figures['dtype']}, greedy, {figures['torch_threads']} torch thread(s); CPU: "
        f"{figures['cpu']}, {figures['num_cpus']} cores, load average {load[0]} -> {load[1]}); "
        f"{figures['rounds']} rounds with the arms in rotating order after a warm-up, ratios "
        f"the median of the rounds' ratios (a round runs every arm back to back); {setup}.")
    table = [_cells(columns), "|---" * len(columns) + "|", *map(_cells, rows)]
    return "\n".join([heading, "", opening, "", *table, "", *([note, ""] if note else [])])


def _cells(cells: list) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def publish(figures: dict, out: Path | None, markdown: Callable[[dict], str]) -> None:
    """The figures as JSON on stdout, and as a Markdown section in `out` when given."""
    print(json.dumps(figures, indent=1))
    if out:
        out.write_text(markdown(figures))
