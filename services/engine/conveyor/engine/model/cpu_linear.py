"""Linear layers on the CPU, with the GEMM kernel that suits the step's row count.

Measured on this project's CPU machine (AMD EPYC, fp32, 30 layers' weights streamed
from DRAM; docs/performance.md, change 7 and issue 19): MKL's GEMM runs 1.2-1.6x slower
than oneDNN with a prepacked weight from 2 to 1,024 rows, so larger steps go through
oneDNN. A decode step of a few rows reads every weight byte once for 2 flops per byte
per row, so it is bound by how fast the weights stream from DRAM: up to GEMV_MAX_ROWS
rows (by dtype and code path) go through native/csrc/gemv.cpp (a streaming GEMV on the
row-major weight), which reads them faster than oneDNN's GEMM does. A layer keeps its
weight twice: row-major for the GEMV, oneDNN-packed for the rest. Where the GEMV cannot
be built (no compiler, no AVX2; logged once) the old split holds: the weight is kept
column-major and one row on one thread takes MKL's GEMV on it.

fp32 weights compute in fp32. bf16 weights (a bf16 model) accumulate in fp32 and round each
output to bf16, in the GEMV (vdpbf16ps on AVX512-BF16, else bf16 widened to fp32 as it is
loaded) and in oneDNN (AMX or AVX512-BF16 tiles), as torch's bf16 matmul does; the kernels
differ only in summation order.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.native.switches import switch

logger = logging.getLogger(__name__)

PACK_BATCH_HINT = 2048
"""Rows oneDNN is told to expect when it picks the packed layout (the default
max_num_batched_tokens); measured within noise of a 16-row hint at 2-32 rows."""


GEMV_EXTENSION = "conveyor_gemv"
GEMV_SOURCES = ("gemv.cpp",)
GEMV_SWITCHES = {torch.float32: "CONVEYOR_FP32_GEMV", torch.bfloat16: "CONVEYOR_BF16_GEMV"}
"""The switch that forces or keeps out the GEMV, by weight dtype (native/switches.py)."""
GEMV_ENTRIES = {torch.float32: "fp32_linear", torch.bfloat16: "bf16_linear"}
GEMV_MAX_ROWS = {torch.float32: {"avx2": 4, "avx512": 16},
                 torch.bfloat16: {"avx2": 2, "avx512": 4, "avx512-bf16": 4}}
"""Steps of at most this many rows take the streaming GEMV, by weight dtype and the code path
it runs (`python -m bench kernel linear`; on AVX-512 its fp32 tiles of 4 weight rows x 6 rows
of x beat oneDNN's packed GEMM up to 16 rows; on AVX2 it keeps to the few-row steps it was
tuned on; in bf16 oneDNN's AMX tiles catch up from ~8 rows)."""
GEMV_ISAS = {"auto": 0, "avx2": 1, "avx512": 2, "avx512-bf16": 3}
GEMV_ISA = GEMV_ISAS.get(switch("CONVEYOR_FP32_GEMV"), 0)
"""The fp32 GEMV's code path: CONVEYOR_FP32_GEMV=avx2 or avx512 forces one (auto: AVX-512 where
the CPU has it); CONVEYOR_FP32_GEMV=off keeps the GEMV out (see gemv_ops)."""
BF16_GEMV_ISA = GEMV_ISAS.get(switch("CONVEYOR_BF16_GEMV"), 0)
"""The bf16 GEMV's code path: CONVEYOR_BF16_GEMV=avx2, avx512 or avx512-bf16 forces one (auto:
the widest the CPU has); CONVEYOR_BF16_GEMV=off keeps the GEMV out."""


def load_gemv() -> ModuleType:
    """The compiled GEMV, built first if need be; raises NativeBuildError."""
    from conveyor.engine.native import CPU_CFLAGS, load_extension

    return load_extension(GEMV_EXTENSION, GEMV_SOURCES, CPU_CFLAGS)


def gemv_isa(dtype: torch.dtype) -> int:
    """The code path the GEMV of `dtype` weights is asked for (its switch; 0: auto)."""
    return BF16_GEMV_ISA if dtype == torch.bfloat16 else GEMV_ISA


def gemv_path(module: ModuleType, dtype: torch.dtype, isa: int) -> str:
    """The name of the code path `isa` runs for `dtype` weights on this CPU."""
    return module.bf16_isa_name(isa) if dtype == torch.bfloat16 else module.isa_name(isa)


@functools.cache
def gemv_ops(dtype: torch.dtype = torch.float32) -> ModuleType | None:
    """The compiled GEMV for `dtype` weights (built first if need be), or None where it is
    switched off (its GEMV_SWITCHES variable =off) or cannot be built or run here (the reason
    logged once)."""
    from conveyor.engine.native import NativeBuildError

    name = GEMV_ENTRIES[dtype].removesuffix("_linear")
    if switch(GEMV_SWITCHES[dtype]) == "off":
        logger.info("%s GEMV switched off (%s=off); using oneDNN/MKL", name,
                    GEMV_SWITCHES[dtype])
        return None
    try:
        module = load_gemv()
        path = gemv_path(module, dtype, gemv_isa(dtype))
    except (NativeBuildError, RuntimeError) as exc:
        logger.warning("%s GEMV unavailable, using oneDNN/MKL for few-row steps: %s", name, exc)
        return None
    logger.info("%s GEMV: native (%s, %s) for steps of up to %d rows", name, GEMV_EXTENSION,
                path, GEMV_MAX_ROWS[dtype][path])
    return module


PACKED_DTYPES = (torch.float32, torch.bfloat16)
"""Weights oneDNN prepacks: fp32, and bf16 where oneDNN runs it (AMX or AVX512-BF16 tiles;
`python -m bench kernel linear --dtype bfloat16`: 1.3-1.6x torch's unpacked bf16 GEMM at 1-256
rows)."""


@functools.cache
def onednn_packing_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacked linear works for `dtype` in this torch build (probed once)."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        weight = torch.ones(4, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), packed, None,
                                                 "none", [], "")
    except (RuntimeError, AttributeError) as exc:  # an op missing from this build
        logger.info("oneDNN prepacked %s linear unavailable (%s); using torch's default GEMM",
                    dtype, exc)
        return False
    return bool(torch.all(out == 8.0))


class CpuLinear(nn.Module):
    """`y = x W^T + b` for x [..., in]: up to gemv_max_rows rows through the streaming
    GEMV on a row-major weight (fp32 or bf16), more through oneDNN's packed GEMM. Without
    the GEMV (another dtype, not built, switched off), one row on one thread goes through
    MKL's GEMV on a column-major weight instead. `weight` stays an [out, in] parameter
    (contiguous, or a transposed view of a contiguous [in, out] tensor), so state dicts and
    parameter names match nn.Linear's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, pack: bool,
                 gemv: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        dtype = weight.dtype
        self._gemv = (gemv_ops(dtype) if gemv and dtype in GEMV_ENTRIES
                      and weight.device.type == "cpu" else None)
        self._gemv_entry = GEMV_ENTRIES.get(dtype, "")
        self._gemv_isa = gemv_isa(dtype)
        self.gemv_path = (None if self._gemv is None
                          else gemv_path(self._gemv, dtype, self._gemv_isa))
        """The GEMV's code path (avx2, avx512, avx512-bf16), None without the GEMV."""
        self.gemv_max_rows = 0 if self._gemv is None else GEMV_MAX_ROWS[dtype][self.gemv_path]
        """Steps of up to this many rows take the GEMV (0: none do)."""
        stored = (weight.detach().contiguous() if self._gemv is not None
                  else weight.detach().t().contiguous().t())
        self.weight = nn.Parameter(stored, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._packed = (torch.ops.mkldnn._reorder_linear_weight(weight.detach(),
                                                                PACK_BATCH_HINT)
                        if pack else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, pack: bool, gemv: bool = True) -> CpuLinear:
        return cls(linear.weight, linear.bias, pack=pack, gemv=gemv)

    @property
    def packed(self) -> bool:
        return self._packed is not None

    @property
    def streams(self) -> bool:
        """Whether steps of up to gemv_max_rows rows take the streaming GEMV."""
        return self._gemv is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows <= self.gemv_max_rows:
            gemv = getattr(self._gemv, self._gemv_entry)
            return gemv(x, self.weight, self.bias, self._gemv_isa)
        if self._packed is None or (rows == 1 and torch.get_num_threads() == 1):
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, self.in_features),
                                                 self._packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed={self.packed}, streams={self.streams}")


def use_cpu_linears(root: nn.Module, dtype: torch.dtype) -> int:
    """Replace every nn.Linear under `root` by a CpuLinear (packed where oneDNN works
    for `dtype`); returns how many were replaced."""
    pack = onednn_packing_available(dtype)
    replaced = 0
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, CpuLinear.from_linear(child, pack=pack))
                replaced += 1
    return replaced
