"""Decode steps replayed from CUDA graphs captured at start, one per batch size.

A decode step launches a few kernels per layer for a handful of tokens, so on a fast
GPU the host's launch time, not the GPU, sets the pace. At start the runner captures
the whole forward pass (embedding to final norm) once per size in `capture_sizes`,
reading the step-input builder's persistent device buffers (fixed addresses). A step
of B requests, one token each, with B within the largest size, is padded up to the
next captured size (`bucket_for`, padding rows write no KV: PADDING_SLOT), its
inputs are filled in place and the graph replays; every other step runs eagerly.

Only the capture needs a device: `DecodeGraphs(..., capture=False)` keeps the same
bucketing, padding and buffers but calls the forward pass directly, which is how the
CPU tests cover this path.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from conveyor.engine.core.scheduler_output import SchedulerOutput
from conveyor.engine.worker.step_inputs import StepInputBuilder, StepInputs

logger = logging.getLogger(__name__)

Forward = Callable[[StepInputs], Callable[[], torch.Tensor]]
"""Given a step's inputs, the zero-argument forward pass over them (plan built once)."""


def capture_sizes(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8 up to max_batch_size, which is always included:
    a step pads by at most 7 rows (vLLM's choice)."""
    if max_batch_size < 1:
        return ()
    sizes = [s for s in (1, 2, 4) if s < max_batch_size]
    sizes += range(8, max_batch_size, 8)
    return (*sizes, max_batch_size)


def bucket_for(output: SchedulerOutput, sizes: Sequence[int]) -> int | None:
    """The captured size a step replays at: the smallest size holding its requests, for
    a pure decode step (one token per request); None (run eagerly) otherwise."""
    num_requests = len(output.scheduled)
    if not sizes or num_requests == 0 or output.num_batched_tokens != num_requests:
        return None
    index = bisect.bisect_left(sizes, num_requests)
    return sizes[index] if index < len(sizes) else None


@dataclass(slots=True)
class DecodeGraph:
    """One size's forward pass: the captured graph and its output buffer, or (without
    capture) the forward itself."""

    forward: Callable[[], torch.Tensor]
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None

    def replay(self) -> torch.Tensor:
        """[size, hidden] final hidden states of the inputs now in the buffers."""
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        return self.hidden


class DecodeGraphs:
    """The captured decode steps of one model runner.

    Invariant: every graph reads the builder's device buffers and the runner's KV pool
    as they were at capture; neither may be reallocated afterwards.
    """

    def __init__(self, builder: StepInputBuilder, forward: Forward, sizes: Sequence[int], *,
                 capture: bool) -> None:
        self.builder = builder
        self.sizes = tuple(sorted(sizes))
        self._graphs: dict[int, DecodeGraph] = {}
        self._pool = None
        start = time.perf_counter()
        for size in sorted(self.sizes, reverse=True):  # largest first: the pool fits all
            self._graphs[size] = self._make(size, forward, capture)
        if capture:
            logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
                        len(self.sizes), ", ".join(map(str, self.sizes)),
                        time.perf_counter() - start)

    def bucket_for(self, output: SchedulerOutput) -> int | None:
        return bucket_for(output, self.sizes)

    def run(self, output: SchedulerOutput, size: int) -> tuple[StepInputs, torch.Tensor]:
        """Fill the buffers with `output` padded to `size`, replay; returns the inputs and
        the [size, hidden] hidden states (rows past the real requests are padding)."""
        inputs = self.builder.build(output, pad_to=size)
        return inputs, self._graphs[size].replay()

    def _make(self, size: int, forward: Forward, capture: bool) -> DecodeGraph:
        run = forward(self.builder.padding_inputs(size))
        if not capture:
            return DecodeGraph(run)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # warm-up: compiles the kernels, settles allocations outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = run()
        self._pool = graph.pool()
        torch.cuda.synchronize()
        return DecodeGraph(run, graph, hidden)
