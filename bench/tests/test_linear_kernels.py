"""The kernel survey on a tiny config: every kernel runs, fp32 kernels are exact to
rounding, the quantized ones are not, slow kernels skip large row counts."""

import torch

from bench.linear_kernels import KERNELS, SLOW, format_survey, forward_shapes, survey

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
        "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 256}


def test_forward_shapes_lists_each_layer_then_lm_head():
    shapes = forward_shapes(TINY, layers=2)
    assert len(shapes) == 2 * 7 + 1 and shapes[-1] == (256, 64)
    assert shapes.count((128, 64)) == 4 and shapes.count((64, 128)) == 2


def test_survey_runs_every_kernel_and_reports_errors():
    from conveyor.engine.model.cpu_linear import gemv_ops

    ops = gemv_ops()  # the gemv kernels need the extension to build here
    wide = ops is not None and ops.has_avx512()
    kernels = [k for k in KERNELS if k != "gemv-avx512-bf16"  # bf16 weights only
               and (ops is not None or not k.startswith("gemv"))
               and (wide or k != "gemv-avx512")]
    with torch.inference_mode():
        results = survey(TINY, [1, 8], kernels, layers=1, max_slow_rows=1)
    by = {(r["kernel"], r["rows"]): r for r in results}
    assert all((k, 1) in by for k in kernels)
    assert all((k, 8) not in by for k in SLOW) and ("engine", 8) in by
    for exact in ("aten-row", "aten-col", "onednn", "gemv", "gemv-avx2", "gemv-avx512",
                  "engine", "engine-before"):
        assert exact not in kernels or by[(exact, 1)]["max_abs_error"] < 1e-5
    assert by[("x.sum()", 1)]["gbps"] > 0 and by[("x.sum()", 8)]["gbps"] > 0
    assert by[("fbgemm-int8", 8)]["max_abs_error"] > 10 * by[("engine", 8)]["max_abs_error"]
    assert all(r["ms"] > 0 and r["gbps"] > 0 for r in results)
    assert all(r["gflops"] > 0 for r in results if r["kernel"] != "x.sum()")
    table = format_survey(results)
    assert "1.00x" in table and "int4-wo" in table
