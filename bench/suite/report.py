"""docs/benchmarks.md from a suite's results: setup, targets, tables, plots, definitions."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench.suite.peer_report import render_peers
from bench.suite.plots import make_plots
from bench.suite.targets_check import check_targets

DEFINITIONS = """\
Definitions (those of `vllm bench serve`): request throughput = completed requests / duration;
output throughput = generated tokens / duration; total throughput = (prompt + generated tokens)
/ duration; TTFT = send to first streamed token; TPOT = (latency - TTFT) / (output tokens - 1)
per request; ITL = every gap between consecutive streamed chunks, pooled; E2EL = send to last
token; percentiles are numpy's. Duration runs from the first send to the last completion. Every
request but those of the peer comparison's `mixed` scenario has `ignore_eos`, so it produces
exactly `max_tokens`. Model FLOP/s = 2 x parameters used
per token (all linear layers incl. lm_head) x (prompt + output) tokens per second."""


def _sweep_table(results: dict) -> list[str]:
    lines = ["| system | conc. | req/s | out tok/s | total tok/s | TTFT p50 / p99 ms | "
             "TPOT p50 / p99 ms | ITL p50 / p99 ms | failed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for system, points in results.get("sweep", {}).items():
        for p in points:
            lines.append(
                f"| {system} | {p['concurrency']} | {p['request_throughput']:.2f} | "
                f"{p['output_throughput']:.1f} | {p['total_token_throughput']:.1f} | "
                f"{p['p50_ttft_ms']:.0f} / {p['p99_ttft_ms']:.0f} | "
                f"{p['p50_tpot_ms']:.1f} / {p['p99_tpot_ms']:.1f} | "
                f"{p['p50_itl_ms']:.1f} / {p['p99_itl_ms']:.1f} | {p['failed']} |")
    return lines


def _roofline_table(roof: dict) -> list[str]:
    lines = [f"torch threads {roof['threads']}; parameters used per token "
             f"{roof['params_per_token'] / 1e6:.1f} M; peak square matmul (2048^3): " +
             ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in roof["peak"].items()), "",
             "| dtype | M (tokens) | " + " | ".join(_shape_names(roof)) + " | whole forward |",
             "|---|---:|" + "---:|" * (len(_shape_names(roof)) + 1)]
    for m in roof["forward"]:
        cells = [f"{s['gflops']:.1f}" for s in roof["shapes"]
                 if s["dtype"] == m["dtype"] and s["tokens"] == m["tokens"]]
        lines.append(f"| {m['dtype']} | {m['tokens']} | " + " | ".join(cells) +
                     f" | **{m['gflops']:.1f}** ({m.get('kernel', 'aten')}) |")
    return lines


def _shape_names(roof: dict) -> list[str]:
    names: list[str] = []
    for s in roof["shapes"]:
        if s["shape"] not in names:
            names.append(s["shape"])
    return names


def _prefix_lines(results: dict) -> list[str]:
    lines = ["| system | prefix tokens | cold TTFT p50 ms | warm TTFT p50 ms | speed-up |",
             "|---|---:|---:|---:|---:|"]
    for name, p in results.get("prefix", {}).items():
        cold, warm = p["cold"]["p50_ttft_ms"], p["warm"]["p50_ttft_ms"]
        lines.append(f"| {name} | {p['prefix_len']} | {cold:.1f} | {warm:.1f} | "
                     f"{cold / max(warm, 1e-9):.1f}x |")
    return lines


def _chunked_lines(results: dict) -> list[str]:
    lines = ["| chunked prefill | step budget | ITL before p50 | during p50 | during p99 | "
             "during max | long prompt TTFT |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, c in results.get("chunked", {}).items():
        lines.append(f"| {name} | {c['max_num_batched_tokens']} | "
                     f"{c['itl_before_p50_ms']:.1f} | {c['itl_during_p50_ms']:.1f} | "
                     f"{c['itl_during_p99_ms']:.1f} | {c['itl_during_max_ms']:.1f} | "
                     f"{c['long_ttft_ms']:.0f} |")
    return lines


def _image(doc: Path, path: Path | None, alt: str) -> list[str]:
    if path is None:
        return []
    return [f"![{alt}]({os.path.relpath(path, doc.parent)})", ""]


def render(results: dict | None, doc: Path, img_dir: Path, peers: dict | None = None,
           inproc: dict | None = None, limits: dict | None = None,
           performance_md: Path | None = None) -> str:
    """The whole report: the peer comparison (when one ran) above the full suite (when one
    ran), then how it is measured."""
    out = ["# Benchmarks", ""]
    if peers:
        out += render_peers(peers, doc, img_dir, inproc, limits, performance_md)
    if results:
        body = _render_suite(results, doc, img_dir)
        out += ["## The full suite: Conveyor against its own baselines (issue 7)", ""]
        out += [("#" + line) if line.startswith("## ") else line for line in body]
    for name in STANDALONE_SECTIONS:
        section = img_dir / name
        if section.is_file():
            out += [section.read_text().rstrip(), ""]
    out += ["## How it is measured", "", DEFINITIONS, "",
            "Baselines: `hf-static` is `bench/baselines/hf_static_server.py` (transformers "
            "`generate`, static batches of up to 64, left-padded, run to the batch's longest "
            "output, streamed per step); `in-process` drives the offline engine "
            "(`conveyor.engine.LLM`) in a closed loop at the same concurrency "
            "(`bench/inprocess_engine.py`). Servers run one at a time.", ""]
    return "\n".join(out)


def _render_suite(results: dict, doc: Path, img_dir: Path) -> list[str]:
    meta = results["meta"]
    plots = make_plots(results, img_dir)
    out = [f"Generated by `{meta['command']}` ({meta['profile']} profile) on {meta['date']}, "
           f"commit {meta['commit']}.", "",
           f"Machine: {meta['cpu']}, {meta['num_cpus']} CPUs, torch {meta['torch']}, "
           f"torch threads {meta['threads']} for every system, model {meta['model']} in "
           f"{meta['dtype']}. "
           f"Workload of the sweep: {meta['input_len']}-token random prompts, "
           f"{meta['output_len']} output tokens, ignore_eos, greedy. Load average (1 min) "
           f"{meta.get('load_average_start', float('nan')):.1f} at the start, "
           f"{meta.get('load_average_end', float('nan')):.1f} at the end; the suite took "
           f"{meta.get('total_s', 0) / 60:.0f} min.", ""]
    if meta.get("note"):
        out += [meta["note"], ""]
    out += ["## Targets", "", "| target | measured | status |", "|---|---|---|"]
    out += [f"| {r.target} | {r.measured} | **{r.status}** |" for r in check_targets(results)]
    out += ["", "## Throughput and latency vs concurrency", ""]
    out += _image(doc, plots.get("throughput"), "throughput vs concurrency")
    out += _image(doc, plots.get("latency"), "TTFT and TPOT vs concurrency")
    out += _sweep_table(results) + [""]
    if results.get("prefix"):
        out += ["## Prefix cache: cold vs warm TTFT", ""]
        out += _image(doc, plots.get("prefix"), "prefix cache cold vs warm")
        out += _prefix_lines(results) + [""]
    if results.get("kv"):
        out += ["## KV slots holding real tokens", "",
                "Conveyor's scheduler and KV cache manager driven through a mixed-length "
                "workload (prompts and outputs uniform in ranges, no model: `bench/"
                "kv_occupancy.py`); contiguous reservation counted for the same running "
                "requests at every step.", ""]
        out += _image(doc, plots.get("kv"), "KV occupancy")
    if results.get("chunked"):
        out += ["## Decode ITL while a long prompt arrives", ""]
        out += _image(doc, plots.get("chunked"), "chunked prefill on vs off")
        out += _chunked_lines(results) + [""]
    if results.get("roofline"):
        out += ["## Practical roofline (GFLOP/s of torch matmuls at the model's shapes)", ""]
        out += _roofline_table(results["roofline"]) + [""]
    out += _gpu_lines(img_dir)
    if results.get("errors"):
        out += ["## Parts that did not run", ""]
        out += [f"- {name}: {msg}" for name, msg in results["errors"].items()] + [""]
    return out


STANDALONE_SECTIONS = ("structured_outputs.md", "speculative.md")
"""Sections that benchmarks run on their own write into the report's img/ folder (`--out`);
each is kept, as written, above "How it is measured"."""

GPU_SECTION = "gpu_check.md"
"""The section `bench/gpu_check.py --out` wrote into the report's img/ folder, if any."""


def _gpu_lines(img_dir: Path) -> list[str]:
    """The GPU section as gpu_check.py wrote it (dated, with the GPU's name), else a line
    saying it has not been measured: a GPU run is never part of this suite or of CI."""
    section = img_dir / GPU_SECTION
    if section.is_file():
        return [section.read_text().rstrip(), ""]
    return ["## On a GPU", "",
            "Not measured yet: no machine with an NVIDIA GPU has been available to run "
            "`bench/gpu_check.py` (Triton kernels against the torch backend, decode attention "
            "bandwidth against a device copy, offline throughput at batch 64 per backend). "
            f"Its `--out docs/img/{GPU_SECTION}` lands here at the next "
            "`bench/run_suite.py --report-only`.", ""]


RESULTS_JSON = "bench_results.json"
PEERS_JSON = "bench_peers.json"
INPROCESS_JSON = "inprocess_targets.json"
LIMITS_JSON = "peer_limits.json"


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def write_report(doc: Path, img_dir: Path, performance_md: Path | None = None) -> None:
    """docs/benchmarks.md from the JSON files in `img_dir` (each part that has one)."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(render(read_json(img_dir / RESULTS_JSON), doc, img_dir,
                          peers=read_json(img_dir / PEERS_JSON),
                          inproc=read_json(img_dir / INPROCESS_JSON),
                          limits=read_json(img_dir / LIMITS_JSON),
                          performance_md=performance_md))
