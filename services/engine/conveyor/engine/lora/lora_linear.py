"""A projection with LoRA adapters applied per row, several adapters in one step.

Each adapted projection keeps `max_loras` slots of adapter weights in two stacked
tensors at fixed addresses (`a` [slots x width, in], `b` [slots x width, out], width =
fused slices x max_rank; adapter.py's layout, zeros in a free slot). A step's rows are
told apart by the slot of their request (`LoraBatch`, -1 for the base model), and the
projection adds `x[t] @ a_s^T @ b_s` to each row t of slot s:

- **Native** (CPU, steps of at most NATIVE_MAX_ROWS rows: decode steps):
  native/csrc/lora_bgmv.cpp, one call per projection, each row reading only its own
  adapter's rank rows (punica's BGMV).
- **Grouped** (larger steps, GPUs, CONVEYOR_LORA_KERNEL=torch): per slot in the step, its
  rows gathered, two GEMMs, the result added back (SGMV by torch ops): ~4 ops per adapter
  in the step, which a prefill chunk's GEMMs dwarf.

A step without adapter rows costs nothing more than the base model.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.native.switches import switch

log = logging.getLogger("conveyor.engine.lora")

EXTENSION = "conveyor_lora_bgmv"
KERNEL_ISAS = {"auto": 0, "avx2": 1, "avx512": 2}
KERNEL = switch("CONVEYOR_LORA_KERNEL")
"""auto, avx2 or avx512 (the native kernel's path; auto: AVX-512 where the CPU has it), or
torch: the grouped torch ops for every step (native/switches.py)."""
NATIVE_MAX_ROWS = 64
"""Steps of up to this many rows take the native kernel: it reads a row's adapter once per
row, which beats two GEMM calls per adapter until a step has many rows per adapter."""


def load_lora_kernel() -> ModuleType:
    """The compiled kernel (built first if need be); NativeBuildError when it cannot be
    built here (no compiler or ninja, a CPU without AVX2)."""
    from conveyor.engine.native import CPU_CFLAGS, load_extension, require_avx2

    require_avx2("the LoRA kernels")
    return load_extension(EXTENSION, ("lora_bgmv.cpp",), CPU_CFLAGS)


@functools.cache
def native_kernel() -> ModuleType | None:
    """The compiled kernel, or None when it cannot be built here (the reason logged once)."""
    from conveyor.engine.native import NativeBuildError

    try:
        return load_lora_kernel()
    except NativeBuildError as exc:
        log.warning("LoRA kernel unavailable, using torch ops: %s", exc)
        return None


class LoraBatch:
    """The step's rows by adapter slot, shared by every LoRA projection of the model; the
    model runner sets it before each forward pass."""

    def __init__(self, max_loras: int, max_rank: int, device: torch.device) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.ranks = torch.zeros(max_loras, dtype=torch.int64)
        """Each slot's adapter rank (0: free); LoraSlots keeps it."""
        self.token_slots: torch.Tensor | None = None
        """[T] each row's slot, -1 for the base model; None: no row has an adapter."""
        self.groups: list[tuple[int, torch.Tensor | None]] = []
        """Per slot in the step: (slot, its rows; None when it has every row)."""
        self.native: ModuleType | None = None
        """The native kernel when this step takes it."""
        self.device = device
        self._kernel = (native_kernel() if device.type == "cpu" and KERNEL != "torch"
                        else None)

    def set_step(self, slots: np.ndarray | None) -> None:
        """`slots` [T]: each row's slot, -1 for the base model (None: no adapters); the
        groups are found on the host, so a GPU step does not wait for the device here."""
        self.token_slots = None if slots is None else torch.from_numpy(slots).to(self.device)
        self.groups = []
        self.native = None
        if slots is None:
            return
        if self._kernel is not None and len(slots) <= NATIVE_MAX_ROWS:
            self.native = self._kernel
            return
        for slot in np.unique(slots[slots >= 0]).tolist():
            rows = np.flatnonzero(slots == slot)
            self.groups.append((slot, None if len(rows) == len(slots) else
                                torch.from_numpy(rows).to(self.device)))


class LoraLinear(nn.Module):
    """`base` (any projection module) plus the adapters in its slots, as `LoraBatch` says."""

    def __init__(self, base: nn.Module, slice_outs: tuple[int, ...], in_features: int,
                 batch: LoraBatch, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.slice_outs = list(slice_outs)
        self.width = len(slice_outs) * batch.max_rank
        slots = batch.max_loras * self.width
        self.register_buffer("a", torch.zeros(slots, in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("b", torch.zeros(slots, sum(slice_outs), dtype=dtype,
                                              device=device), persistent=False)

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put an adapter's (a, b) for this projection in `slot` (None: it leaves this
        projection alone, zeros)."""
        rows = slice(slot * self.width, (slot + 1) * self.width)
        if weights is None:
            self.a[rows].zero_()
            self.b[rows].zero_()
        else:
            self.a[rows].copy_(weights[0])
            self.b[rows].copy_(weights[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.batch
        if batch.native is not None:
            batch.native.lora_bgmv_(y, x, self.a, self.b, batch.token_slots, batch.ranks,
                                    batch.max_rank, self.slice_outs, KERNEL_ISAS.get(KERNEL, 0))
            return y
        for slot, rows in batch.groups:
            a = self.a[slot * self.width:(slot + 1) * self.width]
            b = self.b[slot * self.width:(slot + 1) * self.width]
            if rows is None:
                y.addmm_(F.linear(x, a), b)
            else:
                y.index_add_(0, rows, F.linear(x.index_select(0, rows), a) @ b)
        return y
