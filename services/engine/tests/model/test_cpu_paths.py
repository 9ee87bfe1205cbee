"""dtype auto on the CPU (bf16 where the CPU has native bf16) and the start-up log's line on
the kernels a CPU engine runs."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from conveyor.engine.native import cpu_features as features_module
from conveyor.engine.native.cpu_features import CpuFeatures, auto_cpu_dtype, cpu_features
from conveyor.engine.settings import EngineSettings

SAPPHIRE_RAPIDS = CpuFeatures(avx2=True, avx512=True, avx512_vnni=True, avx512_bf16=True,
                              amx=True)
ZEN4 = CpuFeatures(avx2=True, avx512=True, avx512_vnni=True, avx512_bf16=True, amx=False)
ICE_LAKE = CpuFeatures(avx2=True, avx512=True, avx512_vnni=True, avx512_bf16=False, amx=False)
ZEN3 = CpuFeatures(avx2=True, avx512=False, avx512_vnni=False, avx512_bf16=False, amx=False)


@pytest.mark.parametrize(("features", "dtype"), [(SAPPHIRE_RAPIDS, "bfloat16"),
                                                 (ZEN4, "bfloat16"), (ICE_LAKE, "float32"),
                                                 (ZEN3, "float32")])
def test_auto_is_bf16_where_the_cpu_has_native_bf16(monkeypatch, features, dtype):
    monkeypatch.setattr(features_module, "cpu_features", lambda: features)
    assert EngineSettings(device="cpu").resolved_dtype() == dtype
    # the weight formats have fp32 kernels only: auto keeps them on fp32
    assert EngineSettings(device="cpu", weight_format="q4_1_int8").resolved_dtype() == "float32"
    assert EngineSettings(device="cpu", dtype="float32").resolved_dtype() == "float32"
    assert EngineSettings(device="cpu", dtype="bfloat16").resolved_dtype() == "bfloat16"


def test_features_name_what_was_found():
    assert SAPPHIRE_RAPIDS.describe() == "avx2 avx512 avx512_vnni avx512_bf16 amx"
    assert ZEN3.describe() == "avx2"
    assert SAPPHIRE_RAPIDS.native_bf16 and ZEN4.native_bf16 and not ICE_LAKE.native_bf16
    here = cpu_features()  # this machine, as torch detects it
    assert here.avx2 == torch.cpu._is_avx2_supported()
    assert auto_cpu_dtype("fp32") == ("bfloat16" if here.native_bf16 else "float32")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_line_names_features_dtype_gemm_attention_weights_threads(dtype):
    from conveyor.engine.model.cpu_paths import describe_cpu_paths
    from devkit.random_model import random_llama

    model = random_llama("tiny", dtype=dtype)
    backend = SimpleNamespace(name="native", kernel_path="avx2", prefill_kernel="avx2")
    line = describe_cpu_paths(model, backend, dtype)
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    assert line.startswith(f"CPU {cpu_features().describe()}; dtype {str(dtype)[6:]}; GEMM ")
    linear = model.lm_head
    if linear.streams:
        assert f"GEMM {name} GEMV ({linear.gemv_path}) up to {linear.gemv_max_rows} rows" in line
    assert "attention native (decode avx2, prefill avx2)" in line
    assert f"weights {name}, " in line
    assert line.endswith(f"; {torch.get_num_threads()} torch threads")
    torch_backend = SimpleNamespace(name="torch")
    assert "; attention torch; " in describe_cpu_paths(model, torch_backend, dtype)


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_a_cpu_engine_logs_its_kernels_at_start(caplog, dtype):
    """The engine's start-up names its kernels; with dtype auto the engine takes this CPU's
    choice (bfloat16 where it has native bf16) and reports it."""
    from conveyor.engine.engine_factory import build_engine_core

    caplog.set_level(logging.INFO, logger="conveyor.engine")
    settings = EngineSettings(model="smollm2-135m-instruct", dtype=dtype,
                              attention_backend="torch", num_kv_blocks=16, max_model_len=64,
                              torch_threads=1)
    threads = torch.get_num_threads()
    try:
        core = build_engine_core(settings)
    finally:
        torch.set_num_threads(threads)
    expected = auto_cpu_dtype("fp32") if dtype == "auto" else dtype
    assert core.info.dtype == expected
    lines = [r.getMessage() for r in caplog.records if " kernels: CPU " in r.getMessage()]
    assert len(lines) == 1
    assert f"; dtype {expected}; GEMM " in lines[0] and "; attention torch; " in lines[0]
    name = {"float32": "fp32", "bfloat16": "bf16"}[expected]
    assert f"weights {name}, " in lines[0] and lines[0].endswith("; 1 torch threads")
