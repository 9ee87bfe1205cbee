"""The worker's tasks (start, chunk, finalize) against the real Redis, a real file
store and a fake gateway (httpx.MockTransport): 503s retried, redelivered chunks
skip written lines, cancel and expiry stop the lines in flight."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from conveyor.batch.batch_starter import start_batch
from conveyor.batch.chunk_runner import run_chunk
from conveyor.batch.settings import BatchSettings
from conveyor.batch.worker_context import WorkerContext
from conveyor.common.batch_queue import CHUNK_TASK
from conveyor.common.batch_record import BatchRecord, BatchStatus
from conveyor.common.batch_store import BatchStore, LineResult, LineUsage
from conveyor.common.file_records import FileRecords
from conveyor.common.file_store import DirectoryFileStore

URL = "/v1/chat/completions"


def reply(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    return httpx.Response(200, headers={"x-request-id": "req-1"}, json={
        "echo": body["messages"][0]["content"],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2}})


class Harness:
    def __init__(self, redis, prefix, tmp_path, handler):
        self.sent: list[tuple[str, list]] = []
        self.store = BatchStore(redis, prefix)
        settings = BatchSettings(files_dir=str(tmp_path), lines_in_flight=2, chunk_size=4,
                                 poll_interval_s=0.05, max_backoff_s=0.05, gateway_token="t")
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://gw")
        self.ctx = WorkerContext(settings, self.store, FileRecords(redis, prefix),
                                 DirectoryFileStore(tmp_path), http,
                                 lambda name, args: self.sent.append((name, args)))

    async def batch(self, num_lines: int, expires_at: int = 2_000_000_000) -> str:
        writer = self.ctx.files.writer("file-input")
        for i in range(num_lines):
            writer.write(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": URL,
                                     "body": {"messages": [{"content": f"m{i}"}]}}).encode()
                         + b"\n")
        writer.commit()
        await self.store.create(BatchRecord("batch_x", "acme", "standard", URL, "file-input",
                                            100, expires_at))
        await start_batch(self.ctx, "batch_x")
        return "batch_x"

    async def run_chunks(self) -> None:
        for name, args in list(self.sent):
            assert name == CHUNK_TASK
            await run_chunk(self.ctx, *args)

    def lines(self, file_id: str | None) -> list[dict]:
        if file_id is None:
            return []
        with self.ctx.files.open(file_id) as file:
            return [json.loads(line) for line in file]


@pytest.fixture
def harness(redis, prefix, tmp_path):
    made: list[Harness] = []

    def make(handler=reply) -> Harness:
        made.append(Harness(redis, prefix, tmp_path, handler))
        return made[-1]

    yield make


async def test_lines_run_in_chunks_and_the_output_keeps_input_order(harness):
    h = harness()
    await h.batch(10)
    assert [args[1:3] for _, args in h.sent] == [[0, 4], [4, 8], [8, 10]]
    await h.run_chunks()
    record = await h.store.get("batch_x")
    assert record.status is BatchStatus.COMPLETED and record.completed == 10
    assert (record.input_tokens, record.output_tokens) == (30, 20)
    output = h.lines(record.output_file_id)
    assert [o["custom_id"] for o in output] == [f"c{i}" for i in range(10)]
    assert output[3]["response"] == {"status_code": 200, "request_id": "req-1",
                                     "body": {"echo": "m3", "usage": {
                                         "prompt_tokens": 3, "completion_tokens": 2}}}
    assert record.error_file_id is None


async def test_a_503_is_retried_not_failed(harness):
    calls = []

    def busy_once(request: httpx.Request) -> httpx.Response:
        calls.append(request.headers["x-conveyor-batch-id"])
        if len(calls) == 1:
            return httpx.Response(503, headers={"retry-after": "0"}, json={"error": {}})
        return reply(request)

    h = harness(busy_once)
    await h.batch(1)
    await h.run_chunks()
    record = await h.store.get("batch_x")
    assert record.status is BatchStatus.COMPLETED and record.failed == 0
    assert calls == ["batch_x", "batch_x"]


async def test_a_redelivered_chunk_skips_written_lines(harness):
    seen = []

    def recording(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content)["messages"][0]["content"])
        return reply(request)

    h = harness(recording)
    await h.batch(4)
    await h.store.record_line("batch_x", 1, LineResult(True, {"custom_id": "c1", "kept": 1}),
                              LineUsage(3, 2))
    await h.run_chunks()
    record = await h.store.get("batch_x")
    assert sorted(seen) == ["m0", "m2", "m3"] and record.completed == 4
    assert h.lines(record.output_file_id)[1] == {"custom_id": "c1", "kept": 1}


async def test_every_line_failing_still_completes_with_an_empty_output(harness):
    h = harness(lambda request: httpx.Response(404, json={"error": {"code": "model_not_found"}}))
    await h.batch(3)
    await h.run_chunks()
    record = await h.store.get("batch_x")
    assert record.status is BatchStatus.COMPLETED and record.failed == 3
    assert h.lines(record.output_file_id) == []
    assert [e["response"]["status_code"] for e in h.lines(record.error_file_id)] == [404] * 3


async def test_cancel_stops_the_lines_in_flight_and_keeps_finished_ones(harness):
    release = asyncio.Event()
    cancelled = []

    async def slow_after_two(request: httpx.Request) -> httpx.Response:
        content = json.loads(request.content)["messages"][0]["content"]
        if content not in ("m0", "m1"):
            try:
                await release.wait()
            except asyncio.CancelledError:
                cancelled.append(content)
                raise
        return reply(request)

    h = harness(slow_after_two)
    await h.batch(4)

    async def cancel_when_two_done():
        while (await h.store.get("batch_x")).completed < 2:
            await asyncio.sleep(0.01)
        await h.store.transition("batch_x", (BatchStatus.IN_PROGRESS,), BatchStatus.CANCELLING)

    await asyncio.gather(h.run_chunks(), cancel_when_two_done())
    record = await h.store.get("batch_x")
    assert record.status is BatchStatus.CANCELLED and record.completed == 2
    assert sorted(cancelled) == ["m2", "m3"]
    assert [o["custom_id"] for o in h.lines(record.output_file_id)] == ["c0", "c1"]


async def test_past_its_window_a_batch_expires_keeping_finished_lines(harness):
    h = harness()
    await h.batch(3, expires_at=1)
    await h.store.record_line("batch_x", 0, LineResult(True, {"custom_id": "c0"}), LineUsage())
    await h.run_chunks()
    record = await h.store.get("batch_x")
    assert record.status is BatchStatus.EXPIRED and record.timestamps["expired_at"] > 0
    assert [o["custom_id"] for o in h.lines(record.output_file_id)] == ["c0"]
    errors = h.lines(record.error_file_id)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("c1", "batch_expired"), ("c2", "batch_expired")]


async def test_a_bad_input_fails_the_batch_without_running_a_line(harness):
    h = harness()
    writer = h.ctx.files.writer("file-input")
    writer.write(b"not json\n")
    writer.commit()
    await h.store.create(BatchRecord("batch_x", "acme", "standard", URL, "file-input", 1, 2))
    await start_batch(h.ctx, "batch_x")
    record = await h.store.get("batch_x")
    assert record.status is BatchStatus.FAILED and h.sent == []
    assert [(e["code"], e["line"]) for e in record.errors] == [("invalid_json_line", 1)]


async def test_a_stopping_worker_hands_the_rest_of_its_chunk_on(harness):
    h = harness()
    await h.batch(4)
    [(_, chunk)] = h.sent
    h.ctx.stopping.set()
    await run_chunk(h.ctx, *chunk)
    assert await h.store.finished_lines("batch_x") == set()
    assert h.sent[-1] == (CHUNK_TASK, chunk)


async def test_an_input_deleted_before_its_chunks_ran_fails_the_batch(harness):
    h = harness()
    await h.batch(4)
    h.ctx.files.delete("file-input")
    await h.run_chunks()
    record = await h.store.get("batch_x")
    assert record.status is BatchStatus.FAILED
    assert [e["code"] for e in record.errors] == ["input_file_missing"]
