"""The block weight formats' storage and kernels (quantized_linear.py says what each is):
each weight class holds one linear's weights in its format and multiplies fp32 activations
by them through the C++ block kernels (native/csrc/block_quant_linear.cpp,
rows8_i8_linear.cpp), or fbgemm for fp16."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

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
