"""The engine's kernel switches: environment variables that force a native kernel's code path
or keep a kernel out, for A/B measurements (docs/performance.md) and for ruling a kernel out
when a result looks wrong. They are read once, at import; the default is what a deployment
should run. docs/configuration.md lists them (scripts/settings_table.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class Switch:
    choices: tuple[str, ...]
    """The values it takes; the first is the default."""
    meaning: str


SWITCHES = MappingProxyType({
    "CONVEYOR_FP32_GEMV": Switch(
        ("auto", "avx2", "avx512", "off"),
        "fp32 decode steps of up to 4 rows (AVX2) or 16 (AVX-512) through the streaming GEMV "
        "(native/csrc/gemv.cpp): auto takes AVX-512 where the CPU has it, avx2/avx512 force "
        "a path, off leaves every step to oneDNN/MKL."),
    "CONVEYOR_BF16_GEMV": Switch(
        ("auto", "avx2", "avx512", "avx512-bf16", "off"),
        "bf16 decode steps of up to 2-4 rows through the streaming GEMV (native/csrc/gemv.cpp): "
        "auto takes the widest path the CPU has (avx512-bf16: vdpbf16ps; avx512, avx2: bf16 "
        "widened to fp32 as loaded), the others force a path, off leaves every step to oneDNN."),
    "CONVEYOR_SWIGLU": Switch(
        ("auto", "avx2", "avx512", "off"),
        "The MLP's silu(gate) * up in one C++ pass (fused_layer_ops.cpp): auto takes AVX-512 "
        "where the CPU has it, avx2/avx512 force a path, off keeps torch's silu and mul."),
    "CONVEYOR_INT8_PREFILL": Switch(
        ("auto", "bf16", "fp32"),
        "Steps past the block kernels' rows (prefill chunks) under an int8 weight format "
        "(q4_1_int8): bf16 runs them through oneDNN on bf16 copies of the weights (AMX tiles "
        "where the CPU has them), the activations rounded to bf16 on the way in; fp32 keeps the "
        "fp32 weights; auto: bf16 where the CPU has native bf16 (AVX512-BF16 or AMX)."),
    "CONVEYOR_LORA_KERNEL": Switch(
        ("auto", "avx2", "avx512", "torch"),
        "LoRA adapters on steps of up to 64 rows through the per-row C++ kernel "
        "(native/csrc/lora_bgmv.cpp): auto takes AVX-512 where the CPU has it, avx2/avx512 "
        "force a path, torch applies adapters with grouped torch GEMMs on every step (as on "
        "steps past 64 rows)."),
    "CONVEYOR_PREFILL_ATTENTION": Switch(
        ("auto", "native", "native-avx2", "native-avx512", "torch"),
        "With attention backend native, prefill chunks through its C++ flash kernel reading "
        "the KV pool in place (native: AVX-512 where the CPU has it, else AVX2; native-avx2 / "
        "native-avx512 force a path), or through the torch backend's gather + SDPA (torch); "
        "auto: torch for a bf16 model on a CPU with AMX (torch's bf16 SDPA runs on AMX tiles, "
        "1.1-2.9x the kernel's fp32 arithmetic), native otherwise."),
})


def switch(name: str) -> str:
    """The switch's value from the environment (its default when unset); a value it does not
    take raises ValueError naming the choices."""
    spec = SWITCHES[name]
    value = os.environ.get(name, spec.choices[0])
    if value not in spec.choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(spec.choices)}")
    return value
