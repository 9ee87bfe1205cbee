"""PNG plots of a peer comparison: throughput per scenario, single-stream latency."""

from __future__ import annotations

from pathlib import Path

from bench.suite.plots import _save, plt

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


def throughput_plot(peers: dict, path: Path) -> Path | None:
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
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, title in ((axes[0], "p50_ttft_ms", "TTFT p50 (ms)"),
                           (axes[1], "p50_tpot_ms", "TPOT p50 (ms)")):
        _grouped_bars(ax, peers, ["c1"], key)
        ax.set_title(f"concurrency 1: {title}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[1].legend(fontsize=7)
    return _save(fig, path)


def make_peer_plots(peers: dict, img_dir: Path) -> dict[str, Path]:
    img_dir.mkdir(parents=True, exist_ok=True)
    made = {"throughput": throughput_plot(peers, img_dir / "bench_peers_throughput.png"),
            "single": single_stream_plot(peers, img_dir / "bench_peers_c1.png")}
    return {name: path for name, path in made.items() if path is not None}
