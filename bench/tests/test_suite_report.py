"""Target checks and the report from synthetic results; roofline and KV helpers."""

import pytest

from bench.kernels import roofline
from bench.kernels.model_shapes import LinearShape, model_flops, params_per_token
from bench.kernels.roofline import KERNELS, measure_forward
from bench.kv_occupancy import measure_occupancy, mixed_workload
from bench.suite.goals import check_targets
from bench.suite.profile import FULL, QUICK
from bench.suite.report import render

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "num_hidden_layers": 30,
           "vocab_size": 49152}


def point(concurrency, out_tps, ttft=100.0, tpot=50.0, total=None):
    return {"concurrency": concurrency, "completed": 8, "failed": 0, "output_throughput": out_tps,
            "total_token_throughput": total or out_tps * 5, "request_throughput": 1.0,
            "p50_ttft_ms": ttft, "p99_ttft_ms": ttft, "mean_tpot_ms": tpot, "p50_tpot_ms": tpot,
            "p99_tpot_ms": tpot, "p50_itl_ms": tpot, "p99_itl_ms": tpot}


def results():
    return {
        "meta": {"command": "cmd", "profile": "quick", "date": "d", "commit": "c", "cpu": "x",
                 "num_cpus": 2, "torch": "t", "threads": 2, "model": "m", "dtype": "float32",
                 "input_len": 256, "output_len": 64},
        "sweep": {
            "hf-static": [point(1, 10, tpot=100), point(16, 20), point(32, 20)],
            "conveyor": [point(1, 30, ttft=103, tpot=25), point(16, 70), point(32, 70)],
            "in-process": [point(1, 31, ttft=100), point(16, 75), point(32, 100, total=1000)],
        },
        "prefix": {"conveyor": {"prefix_len": 1000, "cold": {"p50_ttft_ms": 600.0},
                                "warm": {"p50_ttft_ms": 100.0}}},
        "kv": {"paged": 0.99, "contiguous_max_tokens": 0.8, "contiguous_max_model_len": 0.3,
               "block_size": 16, "max_model_len": 2048},
        "roofline": {"threads": 2, "params_per_token": 134_500_000, "peak": {"float32": 100.0},
                     "shapes": [{"dtype": "float32", "tokens": 64, "shape": "q", "gflops": 50}],
                     "forward": [{"dtype": "float32", "tokens": 64, "shape": "forward",
                                  "gflops": 300.0}]},
        "chunked": {"on": {"long_prompt_len": 2000, "max_num_batched_tokens": 256,
                           "itl_before_p50_ms": 50, "itl_during_p50_ms": 60,
                           "itl_during_p99_ms": 90, "itl_during_max_ms": 95,
                           "long_ttft_ms": 3000}},
        "errors": {},
    }


def test_targets_met_and_not_met():
    rows = {r.target: r for r in check_targets(results())}
    status = [r.status for r in rows.values()]
    assert status == ["met", "not met", "met", "met", "not met", "met", "met", "met", "met"]
    flops = next(r for r in rows.values() if "FLOP" in r.target)
    assert "269.0 GFLOP/s" in flops.measured and "90%" in flops.measured
    assert "+3.0 ms" in next(r.measured for r in rows.values() if "TTFT (c" in r.target
                             or "p50 TTFT" in r.target)


def test_missing_parts_are_not_measured():
    rows = check_targets({"sweep": {}, "meta": {}})
    assert {r.status for r in rows} == {"not measured"}


def test_report_renders_tables_and_plots(tmp_path):
    doc = tmp_path / "benchmarks.md"
    text = render(results(), doc, tmp_path / "img")
    for name in ("throughput", "latency", "prefix", "kv", "chunked"):
        assert (tmp_path / "img" / f"bench_{name}.png").stat().st_size > 1000
        assert f"img/bench_{name}.png" in text
    assert "| conveyor | 16 |" in text and "**not met**" in text


def test_params_and_model_flops_of_smollm2():
    assert params_per_token(SMOLLM2) == 134_479_872
    assert model_flops(SMOLLM2, 100.0) == pytest.approx(2 * 134_479_872 * 100)


def test_forward_measurement_runs_on_small_shapes():
    shapes = [LinearShape("a", 8, 16, 2), LinearShape("b", 16, 8, 1)]
    for kernel in KERNELS:
        assert measure_forward(shapes, 4, __import__("torch").float32, 0.001, kernel) > 0


def test_roofline_keeps_the_best_kernel_per_measurement(monkeypatch):
    import torch

    config = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
              "num_key_value_heads": 1, "num_hidden_layers": 1, "vocab_size": 64}
    fake = {"aten": 10.0, "engine": 30.0}
    monkeypatch.setattr(roofline, "measure_shape", lambda *a: fake[a[4]])
    monkeypatch.setattr(roofline, "measure_forward", lambda *a: fake[a[4]] * 2)
    monkeypatch.setattr(roofline, "measure_peak", lambda *a: 1.0)
    out = roofline.run_roofline(config, ["float32"], (4,), 0.001)
    assert {(m["gflops"], m["kernel"]) for m in out["shapes"]} == {(30.0, "engine")}
    assert out["forward"] == [{"dtype": "float32", "tokens": 4, "shape": "forward",
                               "gflops": 60.0, "kernel": "engine"}]
    assert torch.get_num_threads() == out["threads"]


def test_paged_kv_holds_real_tokens():
    occupancy = measure_occupancy(mixed_workload(40, seed=1), block_size=16)
    assert occupancy.paged > 0.95 > occupancy.contiguous_max_tokens
    assert occupancy.contiguous_max_model_len < occupancy.contiguous_max_tokens


def test_profiles():
    assert FULL.num_prompts(16) == 32 and QUICK.num_prompts(1) == QUICK.min_prompts
    assert 16 in FULL.concurrency_levels and 32 in FULL.concurrency_levels


class FakeTarget:
    name = "fake"

    def __init__(self):
        self.calls = []

    def run(self, requests, concurrency, num_warmup=1, duration_s=None):
        from bench.serving.client import RequestResult
        from bench.serving.metrics import calculate_metrics

        self.calls.append(concurrency)
        results = [RequestResult(prompt_len=r.prompt_len, success=True, ttft=0.1, latency=0.5,
                                 itl=[0.1] * 3, output_tokens=r.max_tokens) for r in requests]
        return calculate_metrics(results, 1.0), results


class FakeMaker:
    def random_requests(self, num, input_len, output_len):
        from bench.serving.workload import BenchRequest

        return [BenchRequest("x", input_len, output_len) for _ in range(num)]


def test_sweep_measures_every_level_within_budget():
    from bench.suite.workloads import concurrency_sweep

    target = FakeTarget()
    points = concurrency_sweep(target, FakeMaker(), QUICK, log=lambda _: None)
    assert [p["concurrency"] for p in points] == list(QUICK.concurrency_levels)
    assert target.calls == [4, 1, 4]  # the warm-up burst, then each level
    assert points[0]["output_throughput"] == QUICK.num_prompts(1) * QUICK.output_len


def test_sweep_past_its_budget_reports_the_levels_skipped():
    from dataclasses import replace

    from bench.suite.workloads import SweepOverBudget, concurrency_sweep

    with pytest.raises(SweepOverBudget, match=r"concurrency \[1, 4\] skipped") as stop:
        concurrency_sweep(FakeTarget(), FakeMaker(), replace(QUICK, sweep_budget_s=-1),
                          log=lambda _: None)
    assert stop.value.points == []


def test_report_only_rebuilds_from_the_json_with_a_new_note(tmp_path):
    import json

    from bench.run_suite import main

    doc = tmp_path / "benchmarks.md"
    (tmp_path / "img").mkdir()
    stored = results()
    stored["meta"]["note"] = "old note"
    (tmp_path / "img" / "bench_results.json").write_text(json.dumps(stored))
    assert main(["--report-only", "--out", str(doc)]) == 0
    assert "old note" in doc.read_text()
    assert main(["--report-only", "--out", str(doc), "--note", "a rerun said so"]) == 0
    assert "a rerun said so" in doc.read_text() and "old note" not in doc.read_text()
    saved = json.loads((tmp_path / "img" / "bench_results.json").read_text())
    assert saved["meta"]["note"] == "a rerun said so"


def test_gpu_section_is_the_gpu_check_output_or_says_not_measured(tmp_path):
    doc = tmp_path / "benchmarks.md"
    assert "Not measured yet" in render(results(), doc, tmp_path / "img")
    (tmp_path / "img" / "gpu_check.md").write_text("## On a GPU: NVIDIA H200, 2026-12-01\n\nPASS\n")
    text = render(results(), doc, tmp_path / "img")
    assert "NVIDIA H200, 2026-12-01" in text and "Not measured yet" not in text


def test_a_standalone_benchmarks_section_is_kept_above_the_definitions(tmp_path):
    doc = tmp_path / "benchmarks.md"
    (tmp_path / "img").mkdir(exist_ok=True)
    (tmp_path / "img" / "structured_outputs.md").write_text("## Structured outputs\n\n1.01x\n")
    text = render(results(), doc, tmp_path / "img")
    assert text.index("## Structured outputs") < text.index("## How it is measured")
