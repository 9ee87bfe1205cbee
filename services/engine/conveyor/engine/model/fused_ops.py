"""A decoder layer's elementwise steps, fused into one C++ loop each on the CPU.

`add_rms_norm_` (the residual add and the next RMSNorm), `rms_norm`, `rotate_` (rotary
on q and k in place) and `silu_and_mul` (the MLP's SwiGLU on the gate_up projection's
output) run native/csrc/fused_layer_ops.cpp on float32 and bfloat16 CPU tensors when it is built
(once, cached: native/loader.py), and the torch ops they replace everywhere else (GPU, float16,
no compiler). The torch versions are the reference the tests hold the C++ to: the add and
the rotation bit for bit, the norm within float32 rounding, SwiGLU within ~1e-6 relative
(its own vector exp); in bf16 (computed in fp32, rounded where torch's bf16 ops round) the add
and the rotation bit for bit, the norm and SwiGLU within an ulp of bf16.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

from conveyor.engine.native.switches import switch

log = logging.getLogger("conveyor.engine.model")

EXTENSION = "conveyor_fused_layer_ops"
SOURCES = ("fused_layer_ops.cpp",)
EXTRA_CFLAGS = ("-ffp-contract=off",)
"""No fused multiply-add contraction: products and sums round as torch's separate ops."""
SWIGLU_ISAS = {"auto": 0, "avx2": 1, "avx512": 2}
SWIGLU_NATIVE = switch("CONVEYOR_SWIGLU") != "off"
"""CONVEYOR_SWIGLU=off keeps the torch ops (native/switches.py)."""
SWIGLU_ISA = SWIGLU_ISAS.get(switch("CONVEYOR_SWIGLU"), 0)
"""silu_and_mul's code path: CONVEYOR_SWIGLU=avx2 or avx512 forces one (auto: AVX-512 where
the CPU has it)."""


def load_fused_ops() -> ModuleType:
    """The compiled ops (built first if need be); raises NativeBuildError when they
    cannot be built here (no compiler or ninja, a CPU without AVX2)."""
    from conveyor.engine.native import CPU_CFLAGS, load_extension, require_avx2

    require_avx2("the fused layer ops")
    return load_extension(EXTENSION, SOURCES, (*CPU_CFLAGS, *EXTRA_CFLAGS))


@functools.cache
def native_ops() -> ModuleType | None:
    """The compiled ops, or None when they cannot be built here (the reason logged once)."""
    from conveyor.engine.native import NativeBuildError

    try:
        module = load_fused_ops()
    except NativeBuildError as exc:
        log.warning("fused layer ops unavailable, using torch ops: %s", exc)
        return None
    log.info("fused layer ops: native (%s)", EXTENSION)
    return module


NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _native_for(x: torch.Tensor) -> ModuleType | None:
    if x.device.type != "cpu" or x.dtype not in NATIVE_DTYPES:
        return None
    return native_ops()


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight in fp32, cast back (as transformers computes it)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, H]."""
    native = _native_for(x)
    if native is None or x.dim() != 2 or x.stride(-1) != 1 or weight.dtype != x.dtype:
        return rms_norm_torch(x, weight, eps)
    return native.rms_norm(x, weight, eps)


def add_rms_norm_(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """`residual += delta` in place, then the RMSNorm of the sum (a new tensor)."""
    native = _native_for(residual)
    if (native is None or residual.dim() != 2 or residual.stride(-1) != 1
            or delta.stride(-1) != 1 or delta.dtype != residual.dtype
            or weight.dtype != residual.dtype):
        return rms_norm_torch(residual.add_(delta), weight, eps)
    return native.add_rms_norm_(residual, delta, weight, eps)


def rotate_torch(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated (rotate-half layout) into a new tensor, in fp32, cast back."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    rotated = torch.mul(x32, cos).add_(torch.cat([x2, x1], dim=-1).mul_(signed_sin))
    return rotated.to(x.dtype)


def rotate_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by the looked-up angles, in place where native (else copied);
    returns the rotated tensor either way."""
    native = _native_for(x)
    if native is None or x.stride(-1) != 1 or cos.dtype != torch.float32:
        return rotate_torch(x, cos, signed_sin)
    native.rotate_(x, cos, signed_sin)
    return x


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [..., 2I] (gate the first half) -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate).mul_(up)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of the gate_up projection's output [T, 2I] -> [T, I]: one pass over the rows
    where native, instead of silu on the strided gate half and a multiply."""
    native = _native_for(gate_up) if SWIGLU_NATIVE else None
    if native is None or gate_up.dim() != 2 or gate_up.stride(-1) != 1:
        return silu_and_mul_torch(gate_up)
    return native.silu_and_mul(gate_up, SWIGLU_ISA)
