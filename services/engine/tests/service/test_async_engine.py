"""The async bridge: a loop thread steps the core; asyncio callers stream, cancel, fail alone."""

from __future__ import annotations

import asyncio
import threading

import pytest

from conveyor.engine.async_engine import AsyncEngine, RequestFailedError
from conveyor.engine.core.errors import DuplicateRequestId
from conveyor.engine.engine_request import EngineRequest
from conveyor.engine.sampling_params import SamplingParams


@pytest.fixture
def engine(support):
    engine = AsyncEngine(support.make_core()).start()
    yield engine
    engine.shutdown()


def _request(request_id, prompt, max_tokens=4, n=1):
    return EngineRequest(request_id, prompt,
                         SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n))


async def _collect(engine, request):
    tokens = {}
    async for delta in engine.generate(request):
        tokens.setdefault(delta.index, []).extend(delta.new_token_ids)
    return tokens


async def _wait_until(predicate, timeout_s=5.0):
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_concurrent_requests_stream_their_own_tokens(engine):
    results = await asyncio.gather(
        *(_collect(engine, _request(f"r{i}", [10 * i + 1, 10 * i + 2], max_tokens=5))
          for i in range(6)))
    for i, tokens in enumerate(results):
        assert tokens == {0: [10 * i + 3 + k for k in range(5)]}
    await _wait_until(lambda: engine.stats().num_free_blocks == engine.stats().num_blocks)


async def test_n_samples_stream_until_every_sample_finished(engine):
    tokens = await _collect(engine, _request("p", list(range(1, 11)), max_tokens=3, n=3))
    assert tokens == {i: [11, 12, 13] for i in range(3)}


async def test_leaving_a_stream_early_aborts_and_frees_the_pool(engine):
    long_run = asyncio.create_task(_collect(engine, _request("other", [1, 2], max_tokens=30)))
    stream = engine.generate(_request("quitter", [40, 41, 42, 43, 44], max_tokens=60))
    async for _ in stream:
        break
    await stream.aclose()
    await long_run
    await _wait_until(lambda: engine.stats().num_running == 0)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.num_waiting == 0
    assert not engine.core.has_unfinished_requests


async def test_cancelling_the_task_aborts_the_request(engine):
    engine.core.runner.step_gate = gate = threading.Event()
    task = asyncio.create_task(_collect(engine, _request("c", [1, 2, 3], max_tokens=50)))
    await _wait_until(lambda: engine.core.has_unfinished_requests)
    task.cancel()
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _wait_until(lambda: not engine.core.has_unfinished_requests)
    await _wait_until(lambda: engine.stats().num_free_blocks == engine.stats().num_blocks)


async def test_abort_from_another_thread_ends_the_stream_with_abort(engine):
    engine.core.runner.step_gate = gate = threading.Event()
    stream = engine.generate(_request("x", [1, 2, 3], max_tokens=50))
    first = asyncio.ensure_future(stream.__anext__())
    await _wait_until(lambda: engine.core.has_unfinished_requests)
    threading.Thread(target=engine.abort, args=("x",)).start()
    gate.set()
    await first
    await _wait_until(lambda: not engine.core.has_unfinished_requests)
    await stream.aclose()


async def test_model_failure_fails_one_request_and_the_rest_continue(engine):
    engine.core.runner.fail_on = 77
    engine.core.runner.step_gate = gate = threading.Event()
    good = asyncio.create_task(_collect(engine, _request("good", [1, 2], max_tokens=8)))
    await _wait_until(lambda: engine.core.has_unfinished_requests)
    gate.set()
    await _wait_until(lambda: engine.core.runner.num_steps >= 2)
    with pytest.raises(RequestFailedError, match="injected model failure"):
        await _collect(engine, _request("bad", [77, 78], max_tokens=8))
    assert (await good) == {0: list(range(3, 11))}


async def test_duplicate_request_id_is_refused_while_the_first_runs(engine):
    engine.core.runner.step_gate = gate = threading.Event()
    first = asyncio.create_task(_collect(engine, _request("dup", [1, 2], max_tokens=3)))
    await _wait_until(lambda: engine.num_streams == 1)
    with pytest.raises(DuplicateRequestId):
        await _collect(engine, _request("dup", [1, 2], max_tokens=3))
    gate.set()
    assert (await first) == {0: [3, 4, 5]}


async def test_a_request_the_core_refuses_fails_alone(engine):
    too_long = _request("long", list(range(1, 100)), max_tokens=60)
    with pytest.raises(ValueError, match="max_model_len"):
        await _collect(engine, too_long)
    assert (await _collect(engine, _request("ok", [1, 2], max_tokens=2))) == {0: [3, 4]}


async def test_a_factory_builds_the_core_on_the_loop_thread_that_steps_it(support):
    """All of the model's torch work on one thread: the thread that builds the core is
    the one that runs its steps (libgomp keeps a pool per thread that opens parallel
    regions; two pools stop its workers spinning between a step's regions)."""
    threads = {}

    def factory():
        threads["build"] = threading.current_thread()
        core = support.make_core()
        step = core.step

        def recording_step():
            threads["step"] = threading.current_thread()
            return step()

        core.step = recording_step
        return core

    engine = AsyncEngine(factory).start()
    try:
        assert engine.core is not None and engine.stats().num_free_blocks > 0
        assert await _collect(engine, _request("f", [1, 2], max_tokens=3)) == {0: [3, 4, 5]}
    finally:
        engine.shutdown()
    assert threads["build"] is threads["step"] is not threading.main_thread()
    assert threads["build"].name == "engine-loop"


def test_a_factory_error_is_raised_by_start_and_the_loop_ends():
    def factory():
        raise ValueError("raise kv_cache_gib")

    engine = AsyncEngine(factory)
    with pytest.raises(ValueError, match="kv_cache_gib"):
        engine.start()
    assert not engine._thread.is_alive()
