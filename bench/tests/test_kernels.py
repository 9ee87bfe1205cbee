"""`python -m bench kernel`: each subcommand runs at tiny sizes and prints its table; the linear
survey's fp32 kernels are exact to rounding and the quantized ones are not; the FMA loop counts
its flops and refuses what it cannot run (the rates themselves are the machine's)."""

import os
import shutil

import pytest
import torch

from bench import kernels
from bench.kernels import fma_peak, linear, roofline
from bench.kernels.model_shapes import forward_shapes

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
        "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 256}


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_model(monkeypatch):
    monkeypatch.setattr(linear, "load_model_config", lambda: TINY)
    monkeypatch.setattr(roofline, "load_model_config", lambda: TINY)


needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                    reason="no C++ compiler: the native kernels cannot build")


@pytest.mark.parametrize("argv", [
    ["linear", "--rows", "1,2", "--kernels", "aten-row,onednn,engine", "--rounds", "1"],
    pytest.param(["decode-attention", "--seqs", "2", "--contexts", "32", "--paths", "avx2",
                  "--fp16-pools", "--bf16", "--rounds", "1"], marks=needs_compiler),
    pytest.param(["prefill-attention", "--lengths", "32", "--rounds", "1"], marks=needs_compiler),
    pytest.param(["prefill-attention", "--contexts", "16:32", "--paths", "native-avx2",
                  "--rounds", "1"], marks=needs_compiler),
    ["roofline", "--dtypes", "float32", "--tokens", "2"],
], ids=lambda argv: " ".join(argv[:2]))
def test_each_subcommand_prints_its_table(argv, tiny_model, capsys):
    assert kernels.main([*argv, "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "1 thread(s)" in lines[0]
    rows = [line for line in lines if line.startswith("| ") and "---" not in line]
    assert len(rows) >= 3 and all(row.count("|") == rows[0].count("|") for row in rows)


def test_forward_shapes_lists_each_layer_then_lm_head():
    shapes = forward_shapes(TINY)
    assert len(shapes) == 2 * 7 + 1 and shapes[-1] == (256, 64)
    assert shapes.count((128, 64)) == 4 and shapes.count((64, 128)) == 2


def test_survey_runs_every_kernel_and_reports_errors():
    from conveyor.engine.model.cpu_linear import gemv_ops

    ops = gemv_ops()  # the gemv kernels need the extension to build here
    wide = ops is not None and ops.has_avx512()
    names = [k for k in linear.KERNELS if (ops is not None or not k.startswith("gemv"))
             and (wide or k != "gemv-avx512")]
    with torch.inference_mode():
        table = linear.survey(TINY, [1, 32], names, rounds=1)
    by = {(r["kernel"], r["rows"]): r for r in table}
    assert all((k, 1) in by for k in names) and ("engine", 32) in by
    assert all((k, 32) not in by for k in linear.SLOW)
    for exact in ("aten-row", "aten-col", "onednn", "gemv", "gemv-avx2", "gemv-avx512",
                  "engine", "engine-before"):
        assert exact not in names or by[(exact, 1)]["max abs err"] < 1e-5
    assert by[("fbgemm-int8", 32)]["max abs err"] > 10 * by[("engine", 32)]["max abs err"]
    assert by[("aten-row", 1)]["vs aten-row"] == "1.00x" and by[("x.sum()", 1)]["GB/s"] > 0
    assert all(r["GFLOP/s"] > 0 for r in table if r["kernel"] != "x.sum()")


@needs_compiler
@pytest.mark.parametrize("lanes", fma_peak.lanes_available())
def test_fma_flops_are_threads_times_chains_times_lanes(lanes):
    chains = fma_peak.kernel().chains_per_thread()
    assert fma_peak.kernel().fma_loop(1000, 1, lanes)[1] == 2 * lanes * chains * 1000
    if torch.get_num_threads() >= 2:
        assert fma_peak.kernel().fma_loop(1000, 2, lanes)[1] == 2 * 2 * lanes * chains * 1000


@needs_compiler
def test_fma_refuses_what_it_cannot_run():
    with pytest.raises(RuntimeError, match="lanes must be 8 or 16"):
        fma_peak.kernel().fma_loop(10, 1, 4)
    with pytest.raises(RuntimeError, match="threads must be in 1.."):
        fma_peak.kernel().fma_loop(10, torch.get_num_threads() + 1, 8)


@needs_compiler
def test_fma_subcommand_prints_a_rate_per_vector_width(capsys):
    assert kernels.main(["fma", "--threads", "1"]) == 0
    rows = capsys.readouterr().out.splitlines()[3:]
    assert [row.split(" | ")[0] for row in rows] == [f"| {n}" for n in fma_peak.lanes_available()]
