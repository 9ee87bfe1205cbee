"""Batch and file metadata against the real Redis: the status machine, lines written
once, tenant ownership, and the directory file store."""

from __future__ import annotations

import pytest

from conveyor.common.batch_record import BatchRecord, BatchStatus
from conveyor.common.batch_store import BatchStore, LineResult, LineUsage, LineWrite
from conveyor.common.file_records import FileRecord, FileRecords
from conveyor.common.file_store import DirectoryFileStore, FileTooLarge

S = BatchStatus


def batch(batch_id: str = "batch_1", tenant: str = "acme", created_at: int = 100) -> BatchRecord:
    return BatchRecord(batch_id, tenant, "standard", "/v1/chat/completions", "file-in",
                       created_at, created_at + 86400, metadata={"k": "v"})


def ok_line(custom_id: str) -> LineResult:
    return LineResult(True, {"custom_id": custom_id})


async def started(store: BatchStore, total: int) -> BatchRecord:
    await store.create(batch())
    assert await store.transition("batch_1", (S.VALIDATING,), S.IN_PROGRESS, total=total) \
        == (True, "in_progress")
    return await store.get("batch_1")


async def test_a_batch_round_trips_as_the_openai_object(redis, prefix):
    store = BatchStore(redis, prefix)
    await store.create(batch())
    record = await store.get("batch_1")
    assert record == batch()
    body = record.to_openai()
    assert body["status"] == "validating" and body["metadata"] == {"k": "v"}
    assert body["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert body["in_progress_at"] is None and body["errors"] is None


async def test_each_line_is_counted_once_and_the_last_starts_finalizing(redis, prefix):
    store = BatchStore(redis, prefix)
    record = await started(store, total=2)
    assert record.timestamps["in_progress_at"] > 0
    usage = LineUsage(input_tokens=5, output_tokens=3, cached_tokens=1)
    assert await store.record_line("batch_1", 0, ok_line("a"), usage) is LineWrite.WRITTEN
    assert await store.record_line("batch_1", 0, ok_line("a"), usage) is LineWrite.DUPLICATE
    failed = LineResult(False, {"custom_id": "b"})
    assert await store.record_line("batch_1", 1, failed, LineUsage()) is LineWrite.LAST
    record = await store.get("batch_1")
    assert (record.status, record.ending) == (S.FINALIZING, "completed")
    assert (record.completed, record.failed) == (1, 1)
    assert (record.input_tokens, record.output_tokens, record.cached_tokens) == (5, 3, 1)
    assert await store.finished_lines("batch_1") == {0, 1}
    assert await store.results("batch_1") == {0: ok_line("a"), 1: failed}


async def test_nothing_is_written_once_the_batch_is_cancelling(redis, prefix):
    store = BatchStore(redis, prefix)
    await started(store, total=3)
    assert await store.transition("batch_1", (S.VALIDATING, S.IN_PROGRESS), S.CANCELLING) \
        == (True, "cancelling")
    assert await store.record_line("batch_1", 0, ok_line("a"), LineUsage()) is LineWrite.REFUSED
    assert await store.finished_lines("batch_1") == set()
    assert await store.transition("batch_1", (S.VALIDATING, S.IN_PROGRESS), S.CANCELLING) \
        == (False, "cancelling")


async def test_status_counts_follow_every_transition(redis, prefix):
    store = BatchStore(redis, prefix)
    await started(store, total=1)
    await store.record_line("batch_1", 0, ok_line("a"), LineUsage())
    await store.transition("batch_1", (S.FINALIZING,), S.COMPLETED, output_file_id="file-o")
    stats = await redis.hgetall(store.stats_key)
    assert {k: int(v) for k, v in stats.items() if int(v)} == {"status:completed": 1,
                                                               "lines:completed": 1}
    record = await store.get("batch_1")
    assert record.output_file_id == "file-o" and record.timestamps["completed_at"] > 0


async def test_batches_belong_to_their_tenant_and_list_newest_first(redis, prefix):
    store = BatchStore(redis, prefix)
    for i in range(5):
        await store.create(batch(f"batch_{i}", created_at=100 + i))
    await store.create(batch("batch_other", tenant="globex"))
    assert await store.get_for("batch_0", "globex") is None
    assert (await store.get_for("batch_0", "acme")).batch_id == "batch_0"
    page, more = await store.list("acme", limit=2)
    assert [r.batch_id for r in page] == ["batch_4", "batch_3"] and more
    page, more = await store.list("acme", after="batch_3", limit=5)
    assert [r.batch_id for r in page] == ["batch_2", "batch_1", "batch_0"] and not more


async def test_file_records_are_the_owners_only(redis, prefix):
    records = FileRecords(redis, prefix)
    for i in range(3):
        await records.add(FileRecord(f"file-{i}", "acme", f"{i}.jsonl", "batch", 10, 100 + i))
    assert await records.get("file-0", "globex") is None
    assert [r.file_id for r in await records.list("acme")] == ["file-2", "file-1", "file-0"]
    assert [r.file_id for r in await records.list("acme", after="file-2", limit=1)] == ["file-1"]
    assert not await records.delete("file-0", "globex")
    assert await records.delete("file-0", "acme")
    assert await records.get("file-0", "acme") is None


def test_directory_store_shows_a_file_only_once_committed(tmp_path):
    store = DirectoryFileStore(tmp_path)
    writer = store.writer("file-a")
    writer.write(b"hello ")
    with pytest.raises(FileNotFoundError):
        store.open("file-a")
    writer.write(b"world")
    assert writer.commit() == 11
    with store.open("file-a") as file:
        assert file.read() == b"hello world"
    store.delete("file-a")
    store.delete("file-a")
    assert list(tmp_path.iterdir()) == []


def test_directory_store_refuses_past_the_limit_and_keeps_nothing(tmp_path):
    store = DirectoryFileStore(tmp_path)
    writer = store.writer("file-big", max_bytes=4)
    writer.write(b"1234")
    with pytest.raises(FileTooLarge):
        writer.write(b"5")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError):
        store.writer("../etc/passwd")
