"""Linear layers on the CPU, with the GEMM kernel that suits the step's row count.

Measured on this project's CPU machine (AMD EPYC, fp32, 30 layers' weights streamed
from DRAM; docs/performance.md, change 7 and issue 19): MKL's GEMM runs 1.2-1.6x slower
than oneDNN with a prepacked weight from 2 to 1,024 rows. For a single row (one stream
decoding) MKL's GEMV on a column-major weight is the quickest on one thread, where oneDNN
is 1.4x slower, but on two threads oneDNN is 1.65x faster than that GEMV. So a layer keeps
its weight twice: column-major for one row on one thread, oneDNN-packed otherwise. Both
compute in fp32 with fp32 accumulation; they differ only in summation order.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

PACK_BATCH_HINT = 2048
"""Rows oneDNN is told to expect when it picks the packed layout (the default
max_num_batched_tokens); measured within noise of a 16-row hint at 2-32 rows."""


def onednn_packing_available(dtype: torch.dtype) -> bool:
    """Whether fp32 oneDNN prepacked linear works in this torch build (probed once)."""
    if dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ones(4, 8)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), packed, None, "none", [], "")
    except (RuntimeError, AttributeError) as exc:  # an op missing from this build
        logger.info("oneDNN prepacked linear unavailable (%s); using torch's default GEMM", exc)
        return False
    return bool(torch.all(out == 8.0))


class CpuLinear(nn.Module):
    """`y = x W^T + b` for x [..., in]: one row on one thread through a column-major
    GEMV, anything else through oneDNN's packed GEMM. `weight` stays an [out, in]
    parameter (a transposed view of a contiguous [in, out] tensor), so state dicts and
    parameter names match nn.Linear's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, pack: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._packed = (torch.ops.mkldnn._reorder_linear_weight(weight.detach(),
                                                                PACK_BATCH_HINT)
                        if pack else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, pack: bool) -> CpuLinear:
        return cls(linear.weight, linear.bias, pack=pack)

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self._packed is None or (rows == 1 and torch.get_num_threads() == 1):
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, self.in_features),
                                                 self._packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed={self.packed}")


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
