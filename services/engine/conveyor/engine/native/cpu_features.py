"""What this CPU offers the engine: the instruction sets that pick dtype auto and name the
kernels' code paths in the start-up log, as torch detects them (the detection oneDNN's own
dispatch uses, so "AMX" here is what torch's bf16 matmuls run on). The C++ kernels decide their
own paths at run time (csrc/cpu_isa.h) from the same CPUID bits."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    avx2: bool
    avx512: bool
    avx512_vnni: bool
    avx512_bf16: bool
    """vdpbf16ps: bf16 pairs multiplied into fp32 (Cooper Lake, Sapphire Rapids, Zen 4 on)."""
    amx: bool
    """AMX tiles, BF16 and INT8 (Sapphire Rapids on), usable by this process."""

    @property
    def native_bf16(self) -> bool:
        """bf16 arithmetic in hardware (AVX512-BF16 or AMX): what makes dtype auto bf16."""
        return self.avx512_bf16 or self.amx

    def describe(self) -> str:
        """The instruction sets found, widest last, e.g. "avx2 avx512 avx512_vnni amx"."""
        names = ("avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")
        found = [name for name in names if getattr(self, name)]
        return " ".join(found) or "no AVX2"


def _torch_says(name: str) -> bool:
    probe = getattr(torch.cpu, f"_is_{name}_supported", None)
    return bool(probe is not None and probe())


@functools.cache
def cpu_features() -> CpuFeatures:
    return CpuFeatures(avx2=_torch_says("avx2"), avx512=_torch_says("avx512"),
                       avx512_vnni=_torch_says("vnni") and _torch_says("avx512"),
                       avx512_bf16=_torch_says("avx512_bf16"), amx=_torch_says("amx_tile"))


def auto_cpu_dtype(weight_format: str) -> str:
    """dtype auto on the CPU: bfloat16 where the CPU has native bf16 and the weights are the
    model's own (fp32 weight format; the quantized formats have fp32 kernels only), else
    float32. bf16 halves the bytes every decode step reads and puts prefill on AMX tiles;
    docs/performance.md gives its accuracy against fp32 (greedy agreement, perplexity)."""
    return "bfloat16" if weight_format == "fp32" and cpu_features().native_bf16 else "float32"
