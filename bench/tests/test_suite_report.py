"""Issue 7's targets and the report from synthetic results; roofline and KV helpers."""

import pytest

from bench.kernels import roofline
from bench.kernels.model_shapes import LinearShape, model_flops, params_per_token
from bench.kernels.roofline import KERNELS, measure_forward
from bench.kv_occupancy import measure_occupancy, mixed_workload
from bench.suite.goals import check_targets
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
    """The engine parts' results (bench_results.json)."""
    return {
        "meta": {"command": "cmd", "profile": "quick", "date": "d", "commit": "c", "cpu": "x",
                 "num_cpus": 2, "torch": "t", "threads": 2},
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


def systems():
    """Scenario figures of the three systems issue 7 compares (bench_peers.json's part)."""
    def system(**scenarios):
        return {"scenarios": scenarios}

    return {"systems": {
        "conveyor": system(c1=point(1, 30, ttft=103, tpot=25), c16=point(16, 70),
                           c64=point(64, 70), **{"c1-prefix": point(1, 5, ttft=100.0),
                                                 "c1-prefix-cold": point(1, 5, ttft=600.0)}),
        "in-process": system(c1=point(1, 31, ttft=100), c16=point(16, 75), c64=point(64, 100)),
        "hf-static": system(c1=point(1, 10, tpot=100), c16=point(16, 20), c64=point(64, 20)),
    }}


def test_targets_met_and_not_met():
    rows = check_targets(systems(), results())
    assert [r.status for r in rows] == ["met", "not met", "met", "not met", "met", "met", "met",
                                        "met"]
    assert rows[4].measured == "103.0 vs 100.0 ms = +3.0 ms"
    assert rows[5].measured == "cold 600.0 ms, warm 100.0 ms = 6.0x"
    assert rows[7].measured.endswith("= 4.00x")


def test_missing_parts_are_not_measured():
    rows = check_targets({"systems": {}})
    assert {r.status for r in rows} == {"not measured"}


def test_report_renders_the_engine_parts_with_their_plots(tmp_path):
    doc = tmp_path / "benchmarks.md"
    text = render(results(), doc, tmp_path / "img")
    for name in ("kv", "chunked"):
        assert (tmp_path / "img" / f"bench_{name}.png").stat().st_size > 1000
        assert f"img/bench_{name}.png" in text
    assert "| on | 256 | 50.0 | 60.0 |" in text and "**300.0** (aten)" in text


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
