"""Request timelines against the real Redis: written in stages, read only by their tenant."""

from __future__ import annotations

import asyncio

import pytest

from conveyor.gateway.tenancy.errors import TimelineNotFound
from conveyor.gateway.tenancy.timeline import Stage, TimelineStore


@pytest.fixture
def store(redis, prefix):
    return TimelineStore(redis, prefix=prefix)


async def test_a_request_timeline_reads_back_its_stages_and_usage(store):
    await store.start("req-1", "acme", arrival=100.0)
    await store.mark("req-1", Stage.ADMITTED, at=100.01)
    await store.mark("req-1", Stage.QUEUED, at=100.05)
    await store.mark("req-1", Stage.FIRST_TOKEN, at=100.25)
    await store.mark("req-1", Stage.FINISHED, at=101.0)
    await store.record("req-1", num_prompt_tokens=40, num_completion_tokens=12,
                       num_cached_tokens=32, engine_id="engine-a", finish_reason="stop")
    timeline = await store.get("req-1", "acme")
    assert (timeline.arrival, timeline.admitted, timeline.queued, timeline.finished) == \
        (100.0, 100.01, 100.05, 101.0)
    assert (timeline.num_prompt_tokens, timeline.num_completion_tokens,
            timeline.num_cached_tokens) == (40, 12, 32)
    assert (timeline.engine_id, timeline.finish_reason) == ("engine-a", "stop")
    body = timeline.to_dict()
    assert body["time_to_first_token_s"] == pytest.approx(0.25)
    assert body["duration_s"] == pytest.approx(1.0)
    assert body["tenant_id"] == "acme"


async def test_a_stage_and_its_values_in_one_mark(store):
    await store.start("req-1", "acme", arrival=100.0)
    await store.mark("req-1", Stage.QUEUED, at=100.5, engine_id="engine-b")
    timeline = await store.get("req-1", "acme")
    assert (timeline.queued, timeline.engine_id) == (100.5, "engine-b")
    with pytest.raises(ValueError, match="not timeline fields"):
        await store.mark("req-1", Stage.FINISHED, tenant_id="someone-else")


async def test_unreached_stages_are_none(store):
    await store.start("req-1", "acme")
    timeline = await store.get("req-1", "acme")
    assert timeline.arrival is not None
    assert timeline.first_token is None and timeline.time_to_first_token_s is None


async def test_another_tenant_cannot_read_it_and_unknown_ids_look_the_same(store):
    await store.start("req-1", "acme")
    with pytest.raises(TimelineNotFound) as hidden:
        await store.get("req-1", "globex")
    with pytest.raises(TimelineNotFound) as unknown:
        await store.get("req-2", "globex")
    assert hidden.value.status_code == unknown.value.status_code == 404
    assert hidden.value.body()["error"]["message"].replace("req-1", "req-2") == \
        unknown.value.body()["error"]["message"]


async def test_timelines_expire(redis, prefix):
    store = TimelineStore(redis, prefix=prefix, ttl_s=0.2)
    await store.start("req-1", "acme")
    await asyncio.sleep(0.3)
    with pytest.raises(TimelineNotFound):
        await store.get("req-1", "acme")


async def test_record_refuses_unknown_fields(store):
    with pytest.raises(ValueError, match="not timeline fields"):
        await store.record("req-1", tenant_id="globex")
