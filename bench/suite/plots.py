"""PNG plots of the benchmarks' results (matplotlib, Agg backend: no display needed): every
system's throughput per scenario and single-stream latency, KV occupancy and chunked prefill."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def kv_plot(results: dict, path: Path) -> Path | None:
    kv = results.get("kv")
    if not kv:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    labels = [f"paged\n(block {kv['block_size']})", "contiguous\nprompt+max_tokens",
              f"contiguous\nmax_model_len {kv['max_model_len']}"]
    values = [kv["paged"], kv["contiguous_max_tokens"], kv["contiguous_max_model_len"]]
    bars = ax.bar(labels, [v * 100 for v in values], color=["tab:green", "tab:orange", "tab:red"])
    ax.bar_label(bars, fmt="%.1f%%")
    ax.set_ylim(0, 105)
    ax.set_ylabel("KV slots holding real tokens (%)")
    ax.set_title("KV occupancy on a mixed-length workload")
    return _save(fig, path)


def chunked_plot(results: dict, path: Path) -> Path | None:
    chunked = results.get("chunked")
    if not chunked:
        return None
    keys = ("itl_before_p50_ms", "itl_during_p50_ms", "itl_during_p99_ms", "itl_during_max_ms")
    labels = ("before p50", "during p50", "during p99", "during max")
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(chunked), 1)
    for i, (name, figures) in enumerate(chunked.items()):
        xs = [j + i * width for j in range(len(keys))]
        ax.bar(xs, [figures[k] for k in keys], width, label=name)
    ax.set_xticks([j + width * (len(chunked) - 1) / 2 for j in range(len(keys))], labels)
    ax.set_ylabel("decode inter-token latency (ms)")
    some = next(iter(chunked.values()))
    ax.set_title(f"Decode ITL while a {some['long_prompt_len']}-token prompt arrives")
    ax.legend(fontsize=8)
    return _save(fig, path)


def make_engine_plots(results: dict, img_dir: Path) -> dict[str, Path]:
    img_dir.mkdir(parents=True, exist_ok=True)
    makers = {"kv": kv_plot, "chunked": chunked_plot}
    made = {name: fn(results, img_dir / f"bench_{name}.png") for name, fn in makers.items()}
    return {name: path for name, path in made.items() if path is not None}


# -- the systems on the scenarios -----------------------------------------------------------

THROUGHPUT_SCENARIOS = ("c16", "c16-prefix", "mixed", "c64", "c64-prefix")


def _systems(peers: dict) -> list[str]:
    return list(peers.get("systems", {}))


def _value(peers: dict, system: str, scenario: str, key: str) -> float | None:
    found = peers["systems"][system]["scenarios"].get(scenario)
    return found[key] if found and found.get("completed") else None


def _grouped_bars(ax, peers: dict, scenarios: list[str], key: str) -> None:
    systems = _systems(peers)
    width = 0.8 / max(len(systems), 1)
    for i, system in enumerate(systems):
        xs, ys = [], []
        for j, scenario in enumerate(scenarios):
            value = _value(peers, system, scenario, key)
            if value is not None:
                xs.append(j + i * width)
                ys.append(value)
        bars = ax.bar(xs, ys, width, label=system)
        ax.bar_label(bars, fmt="%.0f", fontsize=6)
    ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(scenarios))], scenarios)


def peer_throughput_plot(peers: dict, path: Path) -> Path | None:
    scenarios = [s for s in THROUGHPUT_SCENARIOS
                 if any(_value(peers, m, s, "output_throughput") for m in _systems(peers))]
    if not scenarios:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.2))
    _grouped_bars(ax, peers, scenarios, "output_throughput")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Output throughput per scenario (same client, same prompts, one server at a "
                 "time)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    return _save(fig, path)


def single_stream_plot(peers: dict, path: Path) -> Path | None:
    if not any(_value(peers, m, "c1", "p50_tpot_ms") for m in _systems(peers)):
        return None
    ttft = [s for s in ("c1", "c1-prefix-cold", "c1-prefix")
            if any(_value(peers, m, s, "p50_ttft_ms") for m in _systems(peers))]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), width_ratios=(len(ttft), 1))
    for ax, key, title, scenarios in ((axes[0], "p50_ttft_ms", "TTFT p50 (ms)", ttft),
                                      (axes[1], "p50_tpot_ms", "TPOT p50 (ms)", ["c1"])):
        _grouped_bars(ax, peers, scenarios, key)
        ax.set_title(f"concurrency 1: {title}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[1].legend(fontsize=7)
    return _save(fig, path)


def make_peer_plots(peers: dict, img_dir: Path) -> dict[str, Path]:
    img_dir.mkdir(parents=True, exist_ok=True)
    made = {"throughput": peer_throughput_plot(peers, img_dir / "bench_peers_throughput.png"),
            "single": single_stream_plot(peers, img_dir / "bench_peers_c1.png")}
    return {name: path for name, path in made.items() if path is not None}
