"""The issue's targets, checked against a suite's results (met / not met / not measured)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TargetRow:
    target: str
    measured: str
    status: str  # "met", "not met" or "not measured"


def _point(results: dict, system: str, concurrency: int) -> dict | None:
    for point in results.get("sweep", {}).get(system, []):
        if point["concurrency"] == concurrency and point["completed"]:
            return point
    return None


def _ratio_row(label: str, results: dict, num: str, den: str, concurrency: int,
               goal: float, key: str = "output_throughput") -> TargetRow:
    a, b = _point(results, num, concurrency), _point(results, den, concurrency)
    if not a or not b:
        return TargetRow(label, f"{num} or {den} not measured at concurrency {concurrency}",
                         "not measured")
    ratio = a[key] / max(b[key], 1e-9)
    measured = f"{a[key]:.1f} vs {b[key]:.1f} tok/s = {ratio:.2f}x"
    return TargetRow(label, measured, "met" if ratio >= goal else "not met")


def model_flops_row(results: dict) -> TargetRow:
    label = "engine model FLOP/s >= 85% of the practical fp32 roofline"
    roof = results.get("roofline")
    points = results.get("sweep", {}).get("in-process", [])
    if not roof or not points:
        return TargetRow(label, "roofline or in-process sweep missing", "not measured")
    best_roof = max(m["gflops"] for m in roof["forward"] if m["dtype"] == "float32")
    best = max(points, key=lambda p: p["total_token_throughput"])
    achieved = 2 * roof["params_per_token"] * best["total_token_throughput"] / 1e9
    share = achieved / best_roof
    measured = (f"{achieved:.1f} GFLOP/s (in-process, concurrency {best['concurrency']}, "
                f"{best['total_token_throughput']:.0f} tok/s) vs roofline {best_roof:.1f} "
                f"GFLOP/s = {share:.0%}")
    return TargetRow(label, measured, "met" if share >= 0.85 else "not met")


def pipeline_rows(results: dict) -> list[TargetRow]:
    rows = [_ratio_row(f"full pipeline >= 90% of in-process throughput (concurrency {c})",
                       results, "conveyor", "in-process", c, 0.9) for c in (16, 32)]
    label = "full pipeline adds <= 5 ms to p50 TTFT (concurrency 1)"
    a, b = _point(results, "conveyor", 1), _point(results, "in-process", 1)
    if not a or not b:
        rows.append(TargetRow(label, "not measured at concurrency 1", "not measured"))
    else:
        added = a["p50_ttft_ms"] - b["p50_ttft_ms"]
        rows.append(TargetRow(label, f"{a['p50_ttft_ms']:.1f} vs {b['p50_ttft_ms']:.1f} ms = "
                              f"{added:+.1f} ms", "met" if added <= 5 else "not met"))
    return rows


def prefix_row(results: dict) -> TargetRow:
    label = "warm prefix TTFT >= 5x better than cold (1,000-token system prompt, conc. 1)"
    prefix = results.get("prefix", {}).get("conveyor") or results.get("prefix", {}).get(
        "in-process")
    if not prefix:
        return TargetRow(label, "not measured", "not measured")
    cold, warm = prefix["cold"]["p50_ttft_ms"], prefix["warm"]["p50_ttft_ms"]
    ratio = cold / max(warm, 1e-9)
    where = "conveyor" if results.get("prefix", {}).get("conveyor") else "in-process"
    return TargetRow(label, f"{where}, {prefix['prefix_len']} tokens: cold {cold:.1f} ms, "
                     f"warm {warm:.1f} ms = {ratio:.1f}x", "met" if ratio >= 5 else "not met")


def kv_row(results: dict) -> TargetRow:
    label = ">= 95% of allocated KV slots hold real tokens"
    kv = results.get("kv")
    if not kv:
        return TargetRow(label, "not measured", "not measured")
    return TargetRow(label, f"paged {kv['paged']:.1%} (contiguous prompt+max_tokens "
                     f"{kv['contiguous_max_tokens']:.1%}, max_model_len "
                     f"{kv['contiguous_max_model_len']:.1%})",
                     "met" if kv["paged"] >= 0.95 else "not met")


def single_stream_row(results: dict) -> TargetRow:
    label = "single-stream decode >= 2x transformers generate tokens/s (concurrency 1)"
    a, b = _point(results, "conveyor", 1), _point(results, "hf-static", 1)
    if not a or not b:
        return TargetRow(label, "not measured at concurrency 1", "not measured")
    tps_a, tps_b = 1000 / max(a["mean_tpot_ms"], 1e-9), 1000 / max(b["mean_tpot_ms"], 1e-9)
    ratio = tps_a / tps_b
    measured = f"served: {tps_a:.1f} vs {tps_b:.1f} tok/s (1/mean TPOT) = {ratio:.2f}x"
    inproc = _point(results, "in-process", 1)
    if inproc:
        tps_c = 1000 / max(inproc["mean_tpot_ms"], 1e-9)
        measured += f"; engine in process {tps_c:.1f} tok/s = {tps_c / tps_b:.2f}x"
    return TargetRow(label, measured, "met" if ratio >= 2 else "not met")


def check_targets(results: dict) -> list[TargetRow]:
    return [
        _ratio_row("output throughput >= 3x static batching (concurrency 16)", results,
                   "conveyor", "hf-static", 16, 3.0),
        _ratio_row("output throughput >= 4x static batching (concurrency 32)", results,
                   "conveyor", "hf-static", 32, 4.0),
        model_flops_row(results),
        *pipeline_rows(results),
        prefix_row(results),
        kv_row(results),
        single_stream_row(results),
    ]
