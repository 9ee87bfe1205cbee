"""Issue 7's targets and the report from synthetic results; roofline and KV helpers."""

import json

from bench.kernels import roofline
from bench.kv_occupancy import measure_occupancy, mixed_workload
from bench.suite.goals import check_targets
from bench.suite.report import render
from bench.tests.fakes import figures, system


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


def test_targets_met_and_not_met():
    """From the scenario figures of the three systems issue 7 compares."""
    rows = check_targets({"systems": {
        "conveyor": system(c1=figures(30, ttft=103, tpot=25), c16=figures(70), c64=figures(70),
                           c1_prefix=figures(5, ttft=100), c1_prefix_cold=figures(5, ttft=600)),
        "in-process": system(c1=figures(31, ttft=100), c16=figures(75), c64=figures(100)),
        "hf-static": system(c1=figures(10, tpot=100), c16=figures(20), c64=figures(20))}},
        results())
    assert [r.status for r in rows] == ["met", "not met", "met", "not met", "met", "met", "met",
                                        "met"]
    assert rows[4].measured == "103.0 vs 100.0 ms = +3.0 ms"
    assert rows[5].measured == "cold 600.0 ms, warm 100.0 ms = 6.0x"
    assert rows[7].measured.endswith("= 4.00x")


def test_an_issue_7_row_from_a_system_on_a_slower_machine_says_so():
    conveyor = system(c16=figures(70))
    static = system(c16=figures(20))
    conveyor["machine"], static["machine"] = ({"matmul_gflops": 100.0, "read_gbs": 10.0},
                                              {"matmul_gflops": 100.0, "read_gbs": 20.0})
    row = check_targets({"systems": {"conveyor": conveyor, "hf-static": static}})[0]
    assert row.status == "met, unreliable: conveyor ran on a slower machine"
    assert {r.status for r in check_targets({"systems": {}})} == {"not measured"}


def test_report_renders_the_engine_parts_then_the_gpu_and_standalone_sections(tmp_path):
    doc, img = tmp_path / "benchmarks.md", tmp_path / "img"
    text = render(results(), doc, img)
    for name in ("kv", "chunked"):
        assert (img / f"bench_{name}.png").stat().st_size > 1000
        assert f"img/bench_{name}.png" in text
    assert "| on | 256 | 50.0 | 60.0 |" in text and "**300.0** (aten)" in text
    assert "Not measured yet" in text  # no GPU section
    (img / "gpu_check.md").write_text("## On a GPU: NVIDIA H200, 2026-12-01\n\nPASS\n")
    (img / "structured_outputs.md").write_text("## Structured outputs\n\n1.01x\n")
    text = render(results(), doc, img)
    assert "NVIDIA H200, 2026-12-01" in text and "Not measured yet" not in text
    assert text.index("## Structured outputs") < text.index("## How it is measured")


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
