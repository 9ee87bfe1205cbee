"""Persistent step-input buffers: a host tensor (pinned on CUDA) and its device twin,
plus the fence that keeps the host side from being rewritten while a copy still reads it.

On CUDA, `prefix` issues a non-blocking host-to-device copy: the copy runs later on
the stream, reading the pinned host memory then. Writing that memory again before the
copy has run would send the next step's values into this step. The builder records a
`CopyFence` after a step's copies and waits on it before writing the host buffers
again; on the CPU the device buffer is the host buffer and the fence never waits.
"""

from __future__ import annotations

import torch


class StagedBuffer:
    """A host buffer (`host`, `np` its numpy view) and, on CUDA, a device twin at a fixed
    address (CUDA graphs read it in place); on the CPU `device is host`."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.np = self.host.numpy()
        self.device = torch.zeros(shape, dtype=dtype, device=device) if on_cuda else self.host

    @property
    def is_staged(self) -> bool:
        """True when filling the device side takes a copy (CUDA)."""
        return self.device is not self.host

    def prefix(self, *sizes: int) -> torch.Tensor:
        """The device view [:sizes[0], :sizes[1], ...], copied from the host first when
        staged (non-blocking: the host prefix must stay untouched until the fence)."""
        index = tuple(slice(0, n) for n in sizes)
        if self.is_staged:
            self.device[index].copy_(self.host[index], non_blocking=True)
        return self.device[index]


class CopyFence:
    """Marks the end of a step's host-to-device copies on the current stream.

    `record` after issuing them; `wait` blocks until they have run (at once when they
    have, or when nothing is pending); `mark_complete` when the caller has just
    synchronised with the stream for another reason (reading sampled tokens), so the
    next `wait` need not block.
    """

    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self.pending = False

    def record(self) -> None:
        if self._event is not None:
            self._event.record()
            self.pending = True

    def wait(self) -> None:
        if self.pending:
            self._event.synchronize()
            self.pending = False

    def mark_complete(self) -> None:
        self.pending = False
