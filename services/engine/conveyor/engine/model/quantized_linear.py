"""Opt-in weight formats for the CPU linears (CONVEYOR_ENGINE_WEIGHT_FORMAT).

A decode step reads every weight once, so its time follows the weight bytes: 540 MB in
fp32 for SmolLM2-135M. A format stores the weights in fewer bytes for steps of up to
`DECODE_MAX_ROWS[format]` rows; larger steps (prefill) keep the fp32 CpuLinear, so they are
unchanged, at the price of keeping the fp32 weights in memory too.

- fp16: weights rounded to fp16 through fbgemm's AVX2 kernel (fp32 activations), 2 bytes a weight.
- q8_0: blocks of 32 int8 values with an fp16 scale (llama.cpp's Q8_0), 1.06 bytes a weight.
- q4_1: the decoder layers in blocks of 32 4-bit values with an fp16 scale and offset
  (llama.cpp's Q4_1), 0.625 bytes a weight; the vocabulary projection in q8_0.
- q4_1_int8: q4_1's weights (lm_head q8_0's), with each block of 32 activations rounded to
  int8 once per call and integer dot products (llama.cpp's Q4_1 x Q8_1): faster, but the
  activation rounding changes results, unlike q4_1's fp32 activations. Its weights are
  packed 8 output rows at a time (Rows8Packing) for native/csrc/rows8_i8_linear.cpp, whose
  integer multiply-adds give 8 rows' dots in the lanes of one vector. Its larger steps
  (prefill) run in bf16 on a CPU with native bf16 (AMX tiles through oneDNN: 2-3x fp32's
  prefill), their weights kept in bf16 instead of fp32 (CONVEYOR_INT8_PREFILL).

The bundled checkpoint is itself Q4_1 with a Q8_0 token embedding, and the blocks are
recovered from the dequantized fp32 weights exactly (the log says which share of blocks
holds the checkpoint's values), so q4_1 computes with the same weights as fp32 and differs
from it only in summation order. The block kernels are our own C++ (native/csrc/
block_quant_linear.cpp: AVX-512 where the CPU has it, else AVX2 + FMA + F16C; a weight's
`isa` forces one), built once and cached; without a compiler the layers stay fp32 and the
engine logs why.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from conveyor.engine.model.block_weights import BLOCK, WEIGHT_CLASSES, FormatUnavailable
from conveyor.engine.model.cpu_linear import CpuLinear, onednn_packing_available
from conveyor.engine.native.cpu_features import CpuFeatures, cpu_features
from conveyor.engine.native.switches import switch

logger = logging.getLogger(__name__)

WEIGHT_FORMATS = ("fp32", "fp16", "q8_0", "q4_1", "q4_1_int8")
"""Values of the weight_format setting; fp32 is the default (no quantized copy)."""
LM_HEAD_FORMAT = {"fp16": "fp16", "q8_0": "q8_0", "q4_1": "q8_0", "q4_1_int8": "q8_0_int8"}
"""The vocabulary projection's format under each setting (q4_1 keeps the Q8_0 of the GGUF's
token embedding)."""
DECODE_MAX_ROWS = {"fp16": 8, "q8_0": 8, "q4_1": 8, "q8_0_int8": 32, "q4_1_int8": 32}
"""Steps of at most this many rows use the format's kernel; larger ones the fp32 CpuLinear
(measured: the former bench/weight_formats.py --rows, docs/performance.md). The int8 formats'
8-row packing beats fp32 up to 64 rows (1.2-1.5x at 16-64 on the sixth round's VM); 32 keeps
longer prompts' prefill in fp32."""
INT8_FORMATS = ("q8_0_int8", "q4_1_int8")
"""The formats that round activations (to int8) already, so their larger steps may run in bf16."""
INT8_PREFILL = switch("CONVEYOR_INT8_PREFILL")
class QuantizedLinear(nn.Module):
    """A CpuLinear whose steps of up to `max_rows` rows read `weights` (a format above)
    instead of the fp32 weight. `dense` takes the larger steps: the fp32 layer, or for an int8
    format on a native-bf16 CPU a bf16 copy of it (the activations cast to bf16 and back)."""

    def __init__(self, dense: CpuLinear, weights, max_rows: int | None = None) -> None:
        super().__init__()
        self.dense, self.weights = dense, weights
        self.bias = None if dense.bias is None else dense.bias.detach()
        """The fp32 bias the format's steps add (`dense` may hold a bf16 copy)."""
        self.max_rows = DECODE_MAX_ROWS[weights.name] if max_rows is None else max_rows
        self.in_features, self.out_features = dense.in_features, dense.out_features

    @property
    def weight_format(self) -> str:
        return self.weights.name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.max_rows:
            return self.dense(x.to(self.dense.weight.dtype)).to(x.dtype)
        out = self.weights.matmul(x.reshape(rows, self.in_features).contiguous())
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.weight_format}, max_rows={self.max_rows}")


def exact_share(layer: QuantizedLinear) -> float:
    """Share of the layer's weights its format reproduces bit for bit (1.0: lossless)."""
    reference = layer.dense.weight.detach()
    return float((layer.weights.dequantize() == reference).float().mean())


def quantize_linears(model: nn.Module, weight_format: str) -> str:
    """Give every CpuLinear under `model` a copy of its weights in `weight_format` (the
    `lm_head` child in LM_HEAD_FORMAT's); returns the format now active: `weight_format`,
    or "fp32" when its kernel is unavailable here (logged with the reason)."""
    if weight_format == "fp32":
        return "fp32"
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format {weight_format!r} is not one of "
                         f"{', '.join(WEIGHT_FORMATS)}")
    try:
        _replace_linears(model, weight_format)
    except FormatUnavailable as exc:
        logger.warning("weight_format %s unavailable, weights stay fp32: %s", weight_format, exc)
        return "fp32"
    return describe_weight_format(model)


def _replace_linears(model: nn.Module, weight_format: str) -> None:
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, CpuLinear)]
    for parent, name, child in targets:
        fmt = LM_HEAD_FORMAT[weight_format] if name == "lm_head" else weight_format
        if fmt != "fp16" and child.in_features % BLOCK:
            logger.info("%s stays fp32: in_features %d is not a multiple of %d",
                        name, child.in_features, BLOCK)
            continue
        setattr(parent, name, QuantizedLinear(child, WEIGHT_CLASSES[fmt](child.weight)))
    _log_exactness(model)
    _larger_steps_in_bf16(model)


def large_step_dtype(weight_format: str, features: CpuFeatures | None = None,
                     choice: str | None = None) -> torch.dtype:
    """The dtype of a layer's steps past its format's rows: bf16 for an int8 format where the
    CPU has native bf16 (CONVEYOR_INT8_PREFILL auto) or where the switch says bf16, else fp32
    (the formats with fp32 activations keep fp32's results)."""
    choice = INT8_PREFILL if choice is None else choice
    if weight_format not in INT8_FORMATS or choice == "fp32":
        return torch.float32
    if choice == "bf16":
        return torch.bfloat16
    return torch.bfloat16 if (features or cpu_features()).native_bf16 else torch.float32


def _larger_steps_in_bf16(model: nn.Module) -> None:
    """Swap the fp32 dense layer of each int8-format layer for a bf16 copy where
    large_step_dtype says so (prefill on AMX tiles; the fp32 weights are freed)."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)
              and large_step_dtype(m.weight_format) == torch.bfloat16]
    pack = onednn_packing_available(torch.bfloat16)
    for layer in layers:
        dense = layer.dense
        bias = None if dense.bias is None else dense.bias.to(torch.bfloat16)
        layer.dense = CpuLinear(dense.weight.to(torch.bfloat16), bias, pack=pack, gemv=False)
    if layers:
        logger.info("int8 format: steps past %d rows run in bf16 (%d layers; "
                    "CONVEYOR_INT8_PREFILL=fp32 keeps fp32)", layers[0].max_rows, len(layers))


def _log_exactness(model: nn.Module) -> None:
    layers = [m for m in model.modules()
              if isinstance(m, QuantizedLinear) and m.weight_format != "fp16"]
    if not layers:
        return
    total = sum(m.in_features * m.out_features for m in layers)
    exact = sum(exact_share(m) * m.in_features * m.out_features for m in layers)
    logger.info("quantized weights reproduce %.2f%% of the fp32 values exactly "
                "(100%% for a checkpoint already in these blocks)", 100 * exact / total)


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def describe_weight_format(model: nn.Module) -> str:
    """The formats the model's linears read in decode steps, e.g. "q4_1 (lm_head q8_0)",
    with the bytes one decode step reads; the linears' dtype ("fp32", "bf16") when none is
    quantized."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    if not layers:
        dense = [m.weight for m in model.modules() if isinstance(m, CpuLinear | nn.Linear)]
        names = sorted({DTYPE_NAMES.get(w.dtype, str(w.dtype)) for w in dense}) or ["fp32"]
        total = sum(w.nbytes for w in dense)
        return f"{'/'.join(names)}, {total / 1e6:.0f} MB of weights per decode step"
    head = layers.pop("lm_head", None)
    formats = sorted({m.weight_format for m in layers.values()})
    text = "/".join(formats)
    if head is not None and head.weight_format not in formats:
        text += f" (lm_head {head.weight_format})"
    total = sum(m.weights.nbytes for m in layers.values()) + (head.weights.nbytes if head else 0)
    return f"{text}, {total / 1e6:.0f} MB of weights per decode step"
