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
import warnings
from collections.abc import Callable

import torch
from torch import nn

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
(measured: bench/weight_formats.py --rows). The int8 formats' 8-row packing beats fp32 up to
64 rows (1.2-1.5x at 16-64 on the sixth round's VM); 32 keeps longer prompts' prefill in fp32."""
INT8_FORMATS = ("q8_0_int8", "q4_1_int8")
"""The formats that round activations (to int8) already, so their larger steps may run in bf16."""
INT8_PREFILL = switch("CONVEYOR_INT8_PREFILL")
BLOCK = 32
ROWS8 = 8
"""The int8-activation formats pack their weights this many output rows at a time."""
ISA_AUTO, ISA_AVX2, ISA_AVX512 = 0, 1, 2
"""The block kernels' code paths (`isa` of a weight): the widest this CPU has, or one forced."""
_EXTENSION = "conveyor_block_quant_linear"
_CFLAGS_EXTRA = ("-mf16c",)

warnings.filterwarnings("ignore", message=r"fbgemm_.*deprecated")


class FormatUnavailable(RuntimeError):
    """A weight format's kernel cannot run here (no compiler, no AVX2, no fbgemm)."""


def load_block_kernels():
    """The C++ block kernels, built on first use; raises NativeBuildError saying why not."""
    from conveyor.engine.native import CPU_CFLAGS, load_extension, require_avx2

    require_avx2("the block kernels")
    return load_extension(_EXTENSION, ["block_quant_linear.cpp", "rows8_i8_linear.cpp"],
                          extra_cflags=(*CPU_CFLAGS, *_CFLAGS_EXTRA))


def block_kernels():
    """load_block_kernels(), raising FormatUnavailable instead."""
    from conveyor.engine.native import NativeBuildError

    try:
        return load_block_kernels()
    except NativeBuildError as exc:
        raise FormatUnavailable(str(exc)) from exc


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    rows, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"in_features {cols} is not a multiple of {BLOCK}")
    return weight.detach().float().reshape(rows, cols // BLOCK, BLOCK)


class Q8_0Weight:
    """w = d * q per block of 32: q int8 in [-127, 127], d fp16 = max|w| / 127."""

    name = "q8_0"

    def __init__(self, weight: torch.Tensor, isa: int = ISA_AUTO) -> None:
        blocks = _blocks(weight)
        self.d = (blocks.abs().amax(-1) / 127).half()
        inverse = torch.where(self.d == 0, 0.0, 1.0 / self.d.float())
        q = torch.round(blocks * inverse[..., None]).clamp_(-127, 127)
        self.qs = q.to(torch.int8).reshape(weight.shape).contiguous()
        self._kernels, self.isa = block_kernels(), isa

    def dequantize(self) -> torch.Tensor:
        return _dequantize_q8_0(self.qs, self.d)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernels.q8_0_linear(x, self.qs, self.d, self.isa)

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes


def _dequantize_q8_0(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    rows, cols = qs.shape
    blocks = qs.float().reshape(rows, cols // BLOCK, BLOCK)
    return (d.float()[..., None] * blocks).reshape(rows, cols)


class Q4_1Weight:
    """w = d * q + m per block of 32: q in 0..15, m fp16 = min(w), d fp16 = (max - min) / 15.
    Two values a byte: weight j of a block in byte j's low nibble, weight j + 16 in its high one."""

    name = "q4_1"

    def __init__(self, weight: torch.Tensor, isa: int = ISA_AUTO) -> None:
        self.qs, self.d, self.m = _q4_1_blocks(weight)
        self._kernels, self.isa = block_kernels(), isa

    def dequantize(self) -> torch.Tensor:
        return _dequantize_q4_1(self.qs, self.d, self.m)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernels.q4_1_linear(x, self.qs, self.d, self.m, self.isa)

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes + self.m.nbytes


def _q4_1_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1Weight's qs uint8 [N, K / 2], d and m fp16 [N, K / 32] of an fp32 weight [N, K]."""
    blocks = _blocks(weight)
    low, high = blocks.amin(-1), blocks.amax(-1)
    m = low.half()
    d = ((high - low) / 15).half()
    inverse = torch.where(d == 0, 0.0, 1.0 / d.float())
    q = torch.round((blocks - m.float()[..., None]) * inverse[..., None]).clamp_(0, 15)
    q = q.to(torch.uint8)
    packed = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
    return packed.reshape(weight.shape[0], -1).contiguous(), d, m


def _dequantize_q4_1(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    rows = qs.shape[0]
    packed = qs.reshape(rows, -1, BLOCK // 2)
    q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
    return (d.float()[..., None] * q + m.float()[..., None]).reshape(rows, -1)


class Q8_0Int8Weight:
    """Q8_0Weight's blocks with each block of 32 activations rounded to int8 (an fp32 scale
    per block) and integer products summed: off the exact product by the activation rounding.
    Stored 8 output rows at a time (Rows8Packing): `qs8` [N8 / 8, K / 32 * 256] int8, `d8`
    [N8 / 8, K / 32 * 8] fp16."""

    name = "q8_0_int8"

    def __init__(self, weight: torch.Tensor, isa: int = ISA_AUTO) -> None:
        plain = Q8_0Weight(weight, isa)
        self._rows8 = Rows8Packing(weight.shape[0], plain.d.shape[1])
        self.qs8 = self._rows8.pack_bytes(plain.qs)
        self.d8 = self._rows8.pack_scales(plain.d)
        self._kernels, self.isa = plain._kernels, isa

    @property
    def qs(self) -> torch.Tensor:
        return self._rows8.unpack_bytes(self.qs8)

    @property
    def d(self) -> torch.Tensor:
        return self._rows8.unpack_scales(self.d8)[0]

    def dequantize(self) -> torch.Tensor:
        return _dequantize_q8_0(self.qs, self.d)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = self._kernels.q8_0_linear_i8(x, self.qs8, self.d8, self.isa)
        return self._rows8.trim(y)

    @property
    def nbytes(self) -> int:
        return self.qs8.nbytes + self.d8.nbytes


class Rows8Packing:
    """The int8-activation kernels' layout (native/csrc/rows8_i8_linear.cpp): output rows in
    groups of 8 (N padded with zero rows to N8), and per group and block, each 4-byte run of a
    block's bytes side by side for the 8 rows, so one 32-byte vector holds one run of every row
    (an int32 lane a row); per group and block the 8 rows' scales (then offsets) likewise."""

    def __init__(self, out_features: int, num_blocks: int) -> None:
        self.out_features, self.num_blocks = out_features, num_blocks
        self.groups = -(-out_features // ROWS8)

    def _padded(self, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.pad(t, (0, 0, 0, self.groups * ROWS8 - self.out_features))

    def pack_bytes(self, qs: torch.Tensor) -> torch.Tensor:
        """[N, blocks * block_bytes] -> [G, blocks * 8 * block_bytes]"""
        runs = self._padded(qs).reshape(self.groups, ROWS8, self.num_blocks, -1, 4)
        return runs.permute(0, 2, 3, 1, 4).reshape(self.groups, -1).contiguous()

    def unpack_bytes(self, qs8: torch.Tensor) -> torch.Tensor:
        runs = qs8.reshape(self.groups, self.num_blocks, -1, ROWS8, 4).permute(0, 3, 1, 2, 4)
        return runs.reshape(self.groups * ROWS8, -1)[:self.out_features]

    def pack_scales(self, *scales: torch.Tensor) -> torch.Tensor:
        """fp16 [N, blocks] each -> [G, blocks * len(scales) * 8]"""
        stacked = torch.stack([self._padded(s) for s in scales])
        grouped = stacked.reshape(len(scales), self.groups, ROWS8, self.num_blocks)
        return grouped.permute(1, 3, 0, 2).reshape(self.groups, -1).contiguous()

    def unpack_scales(self, packed: torch.Tensor) -> torch.Tensor:
        """-> [len(scales), N, blocks]"""
        grouped = packed.reshape(self.groups, self.num_blocks, -1, ROWS8).permute(2, 0, 3, 1)
        return grouped.reshape(grouped.shape[0], self.groups * ROWS8, -1)[:, :self.out_features]

    def trim(self, y: torch.Tensor) -> torch.Tensor:
        """The kernel's output [M, N8] without the padding rows' columns."""
        return y if y.shape[1] == self.out_features else y[:, :self.out_features].contiguous()


class Q4_1Int8Weight:
    """Q4_1Weight's blocks with int8 activations as in Q8_0Int8Weight; the offset term
    m * sum(x) uses the block's fp32 sum of x, so only d * sum(q x) sees the rounding.
    Stored 8 output rows at a time (Rows8Packing): `qs8` [N8 / 8, K / 32 * 128] uint8, `dm8`
    [N8 / 8, K / 32 * 16] fp16 (a block's 8 scales, then its 8 offsets)."""

    name = "q4_1_int8"

    def __init__(self, weight: torch.Tensor, isa: int = ISA_AUTO) -> None:
        qs, d, m = _q4_1_blocks(weight)
        self._rows8 = Rows8Packing(weight.shape[0], d.shape[1])
        self.qs8, self.dm8 = self._rows8.pack_bytes(qs), self._rows8.pack_scales(d, m)
        self._kernels, self.isa = block_kernels(), isa

    @property
    def qs(self) -> torch.Tensor:
        return self._rows8.unpack_bytes(self.qs8)

    @property
    def d(self) -> torch.Tensor:
        return self._rows8.unpack_scales(self.dm8)[0]

    @property
    def m(self) -> torch.Tensor:
        return self._rows8.unpack_scales(self.dm8)[1]

    def dequantize(self) -> torch.Tensor:
        return _dequantize_q4_1(self.qs, self.d, self.m)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._rows8.trim(self._kernels.q4_1_linear_i8(x, self.qs8, self.dm8, self.isa))

    @property
    def nbytes(self) -> int:
        return self.qs8.nbytes + self.dm8.nbytes


class Fp16Weight:
    """The weight rounded to fp16 in fbgemm's packed layout (fp32 activations and output)."""

    name = "fp16"

    def __init__(self, weight: torch.Tensor) -> None:
        self.shape = weight.shape
        try:
            self.packed = torch.fbgemm_pack_gemm_matrix_fp16(weight.detach().float())
        except RuntimeError as exc:  # a torch build without fbgemm
            raise FormatUnavailable(f"fbgemm fp16 is not in this torch build ({exc})") from exc

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fbgemm_linear_fp16_weight_fp32_activation(x, self.packed, None)

    @property
    def nbytes(self) -> int:
        return 2 * self.shape[0] * self.shape[1]


WEIGHT_CLASSES: dict[str, Callable[[torch.Tensor], object]] = {
    "fp16": Fp16Weight, "q8_0": Q8_0Weight, "q4_1": Q4_1Weight,
    "q8_0_int8": Q8_0Int8Weight, "q4_1_int8": Q4_1Int8Weight}


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
