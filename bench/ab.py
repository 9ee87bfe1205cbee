"""The one A/B runner: variants by settings or git revision, alternating rounds in fresh
processes, medians with each variant's ratio to the first and the spread of that ratio.

A variant is `NAME`, `NAME=KEY=VALUE[,KEY=VALUE...]` (environment entries of its processes:
`CONVEYOR_ENGINE_DTYPE=bfloat16`, a kernel switch, ...) or `NAME@REV[=...]`: the code of git
revision REV (or of the checkout at path REV), whose packages come first on PYTHONPATH while
the benchmark itself runs from this tree. A revision is checked out once into a worktree
under `$TMPDIR/conveyor-ab/` with its protos generated.

Each round runs every variant once, each in a fresh process, in rotating order (A B, B A, ...;
bench/arms.py): a machine that drifts during a round favours no variant. A child
writes its figures as JSON (`{"figure": number}`); the summary is their median over rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bench.arms import run_rounds
from bench.children import run_python

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    rev: str | None = None

    @classmethod
    def parse(cls, spec: str) -> Variant:
        head, _, settings = spec.partition("=")
        name, _, rev = head.partition("@")
        if not name:
            raise ValueError(f"variant {spec!r}: expected NAME[@REV][=KEY=VALUE,...]")
        return cls(name, key_values(settings, f"variant {spec!r}"), rev or None)


def key_values(text: str, what: str) -> dict[str, str]:
    """"A=1,B=x" -> {"A": "1", "B": "x"}; ValueError naming `what` for an entry without =."""
    pairs = {}
    for entry in filter(None, text.split(",")):
        key, sep, value = entry.partition("=")
        if not sep:
            raise ValueError(f"{what}: {entry!r} is not KEY=VALUE")
        pairs[key] = value
    return pairs


def package_path(tree: Path) -> str:
    """The package folders of a checkout (common and each service), for PYTHONPATH: they come
    before the .venv's editable installs, so the checkout's code is what runs."""
    folders = [tree / "common", *sorted((tree / "services").iterdir())]
    return os.pathsep.join(str(f) for f in folders if (f / "conveyor").is_dir())


def checkout(rev: str) -> Path:
    """A checkout of `rev`: the path itself when it is a folder, else a worktree (made once)."""
    if Path(rev).is_dir():
        return Path(rev).resolve()
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=REPO_ROOT,
                         check=True, capture_output=True, text=True).stdout.strip()
    tree = Path(tempfile.gettempdir()) / "conveyor-ab" / sha[:12]
    if not tree.is_dir():
        # A worktree whose folder was deleted (a cleared $TMPDIR) stays registered, and git
        # refuses to add one at its path again until the registration is pruned.
        for command in (["prune"], ["add", "--detach", str(tree), sha]):
            subprocess.run(["git", "worktree", *command], cwd=REPO_ROOT, check=True,
                           capture_output=True)
        subprocess.run([sys.executable, "scripts/gen_protos.py"], cwd=tree, check=True)
    return tree


def variant_env(variant: Variant) -> dict[str, str]:
    """The environment of a variant's processes (its services inherit it)."""
    env = {**os.environ, **variant.env}
    if variant.rev:
        env["PYTHONPATH"] = os.pathsep.join(
            [package_path(checkout(variant.rev)), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    return env


def run_child(argv: list[str], variant: Variant) -> dict[str, float]:
    """`python -m bench ARGV --json-out FILE` in a fresh process with the variant's code and
    environment; the figures it wrote."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        run_python(["-m", "bench", *argv, "--json-out", out.name], env=variant_env(variant),
                   cwd=REPO_ROOT)
        return json.loads(Path(out.name).read_text())


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """Per variant and figure: the median over rounds, its ratio to the first variant's
    median, and the lowest and highest per-round ratio (rounds paired by index)."""
    base_name = next(iter(runs))
    base = runs[base_name]
    rows = []
    for name, rounds in runs.items():
        for figure in rounds[0]:
            values = [r[figure] for r in rounds if figure in r]
            base_values = [r[figure] for r in base if r.get(figure)]
            median = statistics.median(values)
            row = {"variant": name, "figure": figure, "median": median, "rounds": len(values)}
            if name != base_name and base_values:
                paired = [r[figure] / b[figure] for r, b in zip(rounds, base, strict=False)
                          if figure in r and b.get(figure)]
                row |= {"ratio": median / statistics.median(base_values),
                        "ratio_low": min(paired), "ratio_high": max(paired)}
            rows.append(row)
    return rows


def format_figures(figures: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.3g}" for k, v in figures.items())


def markdown(rows: list[dict]) -> str:
    """One table: a row per figure, a column per variant (median; ratio and its spread)."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    figures = list(dict.fromkeys(r["figure"] for r in rows))
    cell = {(r["variant"], r["figure"]): r for r in rows}
    lines = ["| figure | " + " | ".join(variants) + " |", "|---|" + "---:|" * len(variants)]
    for figure in figures:
        cells = []
        for variant in variants:
            row = cell.get((variant, figure))
            text = f"{row['median']:.4g}" if row else ""
            if row and "ratio" in row:
                text += f" ({row['ratio']:.3f}x, {row['ratio_low']:.2f}-{row['ratio_high']:.2f})"
            cells.append(text)
        lines.append(f"| {figure} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compare(variant_specs: list[str], rounds: int, child_argv: list[str],
            out: Path | None = None) -> list[dict]:
    """Parse the variants, run `child_argv` for each over `rounds`, print the summary table
    (and write every run and the summary to `out` as JSON)."""
    variants = {v.name: v for v in map(Variant.parse, variant_specs)}
    runs = run_rounds(list(variants), rounds, lambda name: run_child(child_argv, variants[name]),
                      warmup=False).samples
    rows = summarize(runs)
    print(markdown(rows))
    if out:
        out.write_text(json.dumps({"variants": variant_specs, "runs": runs, "summary": rows},
                                  indent=1))
    return rows
