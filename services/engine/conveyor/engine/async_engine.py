"""The engine loop in a thread of its own, bridged to asyncio callers.

The loop thread alone touches the EngineCore. Callers on any thread hand it
adds and aborts through an inbox; the loop applies them at the next step
boundary, steps while any request is alive and sleeps otherwise. Each request's
deltas reach its caller's event loop through `loop.call_soon_threadsafe` into a
per-request asyncio queue.

Given a factory instead of a core, the loop thread builds the core itself, so the
model's parallel torch work (loading, warm-up, every step) runs on one thread only.
libgomp keeps a thread pool per thread that opens parallel regions, and once it
manages more threads than there are CPUs it stops spinning between regions: with
the core built on another thread (an asyncio executor's), the loop thread's workers
sleep and wake around each of a decode step's ~150 regions, and a one-row step took
twice as long (docs/performance.md, "One thread for the engine's torch work").
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from conveyor.engine.core.errors import DuplicateRequestId
from conveyor.engine.engine_core import EngineCore
from conveyor.engine.engine_request import EngineRequest
from conveyor.engine.engine_stats import EngineStats
from conveyor.engine.iteration_stats import IterationStats
from conveyor.engine.lora.adapter_store import AdapterStore
from conveyor.engine.metrics import EngineMetrics
from conveyor.engine.request_delta import RequestDelta
from conveyor.engine.structured.errors import InvalidConstraint

log = logging.getLogger("conveyor.engine.loop")

IDLE_WAIT_S = 0.01
"""How long the loop waits when requests exist but none could be scheduled."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (a model error); the message says why."""


class EngineStoppedError(RuntimeError):
    """The engine loop has stopped; no request can run."""


@dataclass(slots=True)
class _Stream:
    """Where one request's deltas go: a queue on its caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_samples: int


@dataclass(slots=True)
class _Inbox:
    """Adds and aborts posted from any thread, applied in order by the loop at a step
    boundary (an abort posted after an add must come after it)."""

    ops: list[EngineRequest | str] = field(default_factory=list)
    """An EngineRequest to add, or the request id to abort."""

    def __bool__(self) -> bool:
        return bool(self.ops)


class AsyncEngine:
    """Runs an EngineCore on a background thread; `generate` streams one request's deltas.

    `core` is the EngineCore, or a function that builds it: then `start` has the loop
    thread build it (the engine server does, see the module docstring) and returns once
    it is built, raising what the factory raised."""

    def __init__(self, core: EngineCore | Callable[[], EngineCore],
                 metrics: EngineMetrics | None = None):
        self._factory = None if isinstance(core, EngineCore) else core
        self.core: EngineCore | None = None if self._factory else core
        self.metrics = metrics
        self._lock = threading.Condition()
        self._inbox = _Inbox()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._stats = None if self._factory else core.stats()
        self._idle = False
        """The latest step found nothing it could run (wait before stepping again)."""
        if self.core is not None:
            self.core.timer.on_iteration = self._on_iteration
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    @property
    def info(self):
        return self.core.info

    @property
    def loras(self) -> AdapterStore | None:
        """The LoRA adapters held (thread-safe: callers on any thread load and unload);
        None when this engine serves none."""
        return self.core.loras

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (or abort) of the loop, with the LoRA
        adapters held as of now (loads and unloads happen off the loop)."""
        loras = self.loras if self.core is not None else None
        if loras is None:
            return self._stats
        return dataclasses.replace(self._stats, lora_adapters=loras.names())

    @property
    def num_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def start(self) -> AsyncEngine:
        """Start the loop; with a factory, wait until the loop thread has built the core."""
        self._thread.start()
        if self._factory is not None:
            self._built.wait()
            if self._build_error is not None:
                self._thread.join()
                raise self._build_error
        return self

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; streams still open end with EngineStoppedError."""
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self.core is not None:
            self.core.close()
        self._fail_all_streams(EngineStoppedError("the engine is shutting down"))

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        """Run `request`, yielding its deltas until every sample finished.

        Leaving early (break, cancellation, an exception in the caller) aborts the
        request at the loop's next step boundary. Raises DuplicateRequestId,
        WaitingQueueFull (refused, or pushed out of the waiting queue before it ran),
        InvalidConstraint (its structured output does not compile, or not in time),
        RequestFailedError (model error) or EngineStoppedError.
        """
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(),
                         request.sampling_params.n)
        self._open(request, stream)
        num_finished = 0
        try:
            while num_finished < stream.num_samples:
                delta = await stream.queue.get()
                if isinstance(delta, BaseException):
                    raise delta
                if delta.error is not None:
                    raise (InvalidConstraint if delta.invalid_request
                           else RequestFailedError)(delta.error)
                num_finished += delta.finished
                yield delta
        finally:
            self._close(request.request_id, aborted=num_finished < stream.num_samples)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; applied at the next step boundary."""
        with self._lock:
            self._inbox.ops.append(request_id)
            self._lock.notify_all()

    def _open(self, request: EngineRequest, stream: _Stream) -> None:
        with self._lock:
            if self._stopped:
                raise EngineStoppedError("the engine is shutting down")
            if request.request_id in self._streams:
                raise DuplicateRequestId(
                    f"request_id {request.request_id!r} is already running")
            self._streams[request.request_id] = stream
            self._inbox.ops.append(request)
            self._lock.notify_all()

    def _close(self, request_id: str, aborted: bool) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            if aborted:
                self._inbox.ops.append(request_id)
                self._lock.notify_all()

    # ---- the loop thread ----

    def _run(self) -> None:
        if self._factory is not None and not self._build_core():
            return
        log.info("engine loop started")
        while True:
            inbox = self._wait_for_work()
            if inbox is None:
                break
            self._apply(inbox)
            stepped = self.core.has_unfinished_requests
            deltas = self._step_once() if stepped else []
            self._publish_stats()  # first: a caller that saw a step's deltas sees its stats
            for delta in deltas:
                self._send(delta.request_id, delta)
            if stepped and self._idle:  # nothing could run: wait a little
                with self._lock:
                    self._lock.wait(IDLE_WAIT_S)
        log.info("engine loop stopped")

    def _build_core(self) -> bool:
        try:
            self.core = self._factory()
            self.core.timer.on_iteration = self._on_iteration
            self._stats = self.core.stats()
        except BaseException as exc:  # re-raised by start() on the caller's thread
            self._build_error = exc
            return False
        finally:
            self._built.set()
        return True

    def _wait_for_work(self) -> _Inbox | None:
        """Block until there is something to do; take the inbox. None means stop."""
        with self._lock:
            while not self._stopped and not self._inbox and not self.core.has_unfinished_requests:
                self._lock.wait()
            if self._stopped:
                return None
            inbox, self._inbox = self._inbox, _Inbox()
            return inbox

    def _apply(self, inbox: _Inbox) -> None:
        for op in inbox.ops:
            if isinstance(op, str):
                self.core.abort([op])
                continue
            try:
                pushed_out = self.core.add_request(op)
            except Exception as exc:  # a request the core refuses fails alone
                self._send(op.request_id, exc)
                continue
            for request_id, error in pushed_out.items():
                self._send(request_id, error)

    def _step_once(self) -> list[RequestDelta]:
        try:
            return self.core.step()
        except Exception as exc:  # a bug outside the model: fail everyone, keep serving
            log.exception("engine step failed; failing all requests")
            self._fail_everything(RequestFailedError(f"engine error: {exc}"))
            return []

    def _on_iteration(self, iteration: IterationStats) -> None:
        """The core's step observer (on the loop thread): metrics, and whether it idled."""
        self._idle = iteration.num_scheduled_tokens == 0
        if self.metrics is not None:
            self.metrics.record_iteration(iteration)

    def _send(self, request_id: str, item: RequestDelta | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:
            return  # the caller left; its abort is in the inbox
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed
            self.abort(request_id)

    def _publish_stats(self) -> None:
        self._stats = self.core.stats()
        if self.metrics is not None:
            self.metrics.record_stats(self._stats)

    def _fail_everything(self, error: Exception) -> None:
        self.core.abort(self.core.unfinished_request_ids)
        self._fail_all_streams(error)

    def _fail_all_streams(self, error: Exception) -> None:
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._send(request_id, error)
