"""Request timelines against the real Redis: written in stages (alone, or inside the
admission's scripts), read only by their tenant."""

from __future__ import annotations

import asyncio

import pytest
from redis.crc import key_slot

from conveyor.gateway.tenancy.api_keys import Tenant
from conveyor.gateway.tenancy.errors import RateLimited, TimelineNotFound
from conveyor.gateway.tenancy.quota_ledger import AdmissionControl
from conveyor.gateway.tenancy.tiers import Tier
from conveyor.gateway.tenancy.timeline import Stage, TimelineDraft, TimelineStore


@pytest.fixture
def store(redis, prefix):
    return TimelineStore(redis, prefix=prefix)


def _draft(store: TimelineStore, request_id: str = "req-1",
           arrival: float | None = None) -> TimelineDraft:
    draft = TimelineDraft(store, request_id)
    if arrival is not None:
        draft.mark(Stage.ARRIVAL, at=arrival)
    return draft


async def test_a_request_timeline_reads_back_its_stages_and_usage(store):
    draft = _draft(store, arrival=100.0)
    draft.mark(Stage.ADMITTED, at=100.01)
    await draft.save("acme")
    draft.mark(Stage.QUEUED, at=100.05)
    draft.mark(Stage.FIRST_TOKEN, at=100.25)
    draft.mark(Stage.FINISHED, at=101.0)
    draft.record(num_prompt_tokens=40, num_completion_tokens=12, num_cached_tokens=32,
                 num_draft_tokens=9, num_accepted_draft_tokens=6, engine_id="engine-a",
                 finish_reason="stop")
    await draft.save("acme")
    timeline = await store.get("req-1", "acme")
    assert (timeline.arrival, timeline.admitted, timeline.queued, timeline.finished) == \
        (100.0, 100.01, 100.05, 101.0)
    assert (timeline.num_prompt_tokens, timeline.num_completion_tokens,
            timeline.num_cached_tokens) == (40, 12, 32)
    assert (timeline.num_draft_tokens, timeline.num_accepted_draft_tokens) == (9, 6)
    assert (timeline.engine_id, timeline.finish_reason) == ("engine-a", "stop")
    body = timeline.to_dict()
    assert body["time_to_first_token_s"] == pytest.approx(0.25)
    assert body["duration_s"] == pytest.approx(1.0)
    assert body["tenant_id"] == "acme"


async def test_a_stage_and_its_values_in_one_mark(store):
    draft = _draft(store, arrival=100.0)
    draft.mark(Stage.QUEUED, at=100.5, engine_id="engine-b")
    await draft.save("acme")
    timeline = await store.get("req-1", "acme")
    assert (timeline.queued, timeline.engine_id) == (100.5, "engine-b")
    with pytest.raises(ValueError, match="not timeline fields"):
        draft.mark(Stage.FINISHED, tenant_id="someone-else")


async def test_unreached_stages_are_none(store):
    await _draft(store).save("acme")
    timeline = await store.get("req-1", "acme")
    assert timeline.arrival is not None
    assert timeline.first_token is None and timeline.time_to_first_token_s is None


async def test_another_tenant_cannot_read_it_and_unknown_ids_look_the_same(store):
    await _draft(store).save("acme")
    with pytest.raises(TimelineNotFound) as hidden:
        await store.get("req-1", "globex")
    with pytest.raises(TimelineNotFound) as unknown:
        await store.get("req-2", "globex")
    assert hidden.value.status_code == unknown.value.status_code == 404
    assert hidden.value.body()["error"]["message"].replace("req-1", "req-2") == \
        unknown.value.body()["error"]["message"]


async def test_timelines_expire(redis, prefix):
    store = TimelineStore(redis, prefix=prefix, ttl_s=0.2)
    await _draft(store).save("acme")
    written_at = asyncio.get_running_loop().time()
    while True:
        try:
            await store.get("req-1", "acme")
        except TimelineNotFound:
            break
        assert asyncio.get_running_loop().time() - written_at < 2, "the timeline never expired"
        await asyncio.sleep(0.02)


async def test_record_and_pending_refuse_unknown_fields(store):
    with pytest.raises(ValueError, match="not timeline fields"):
        _draft(store).record(tenant_id="globex")
    with pytest.raises(ValueError, match="not timeline fields"):
        _draft(store).pending("acme", colour="blue")


def test_a_timeline_lies_in_its_tenants_cluster_slot(redis, prefix):
    store = TimelineStore(redis, prefix=prefix)
    write = _draft(store).pending("acme")
    quota_key = f"{prefix}:quota:{{acme}}:concurrency"
    assert key_slot(write.key.encode()) == key_slot(quota_key.encode())
    assert key_slot(_draft(store).pending("globex").key.encode()) != \
        key_slot(write.key.encode())


# -- inside the admission's scripts ------------------------------------------------------

def _tenant(rpm: int | None = None) -> Tenant:
    return Tenant("acme", Tier("t", priority=10, requests_per_minute=rpm, tokens_per_minute=None,
                               max_concurrent_requests=None))


async def test_admit_writes_the_timeline_of_an_admitted_request_only(redis, prefix, store):
    control = AdmissionControl(redis, prefix=prefix)
    admitted = _draft(store, "req-1", arrival=100.0)
    await control.admit(_tenant(rpm=1), "rsv-1", 10, 10,
                        admitted.pending("acme", admitted=100.5, num_prompt_tokens=10))
    timeline = await store.get("req-1", "acme")
    assert (timeline.arrival, timeline.admitted, timeline.num_prompt_tokens) == \
        (100.0, 100.5, 10)
    assert timeline.finished is None
    refused = _draft(store, "req-2", arrival=101.0)
    with pytest.raises(RateLimited):
        await control.admit(_tenant(rpm=1), "rsv-2", 10, 10, refused.pending("acme"))
    with pytest.raises(TimelineNotFound):
        await store.get("req-2", "acme")


async def test_settle_writes_the_end_of_the_timeline_even_when_never_admitted(
        redis, prefix, store):
    control = AdmissionControl(redis, prefix=prefix)
    acme = _tenant()
    reservation = await control.admit(acme, "rsv-1", 10, 10)
    draft = _draft(store, "req-1", arrival=100.0)
    draft.mark(Stage.FINISHED, at=102.0, finish_reason="stop", num_completion_tokens=4)
    assert await control.settle(reservation, 4, timeline=draft.pending("acme")) == 6
    timeline = await store.get("req-1", "acme")
    assert (timeline.finished, timeline.finish_reason) == (102.0, "stop")
    never = _draft(store, "req-2")
    never.mark(Stage.FINISHED, finish_reason="cancelled")
    lost = type(reservation)("rsv-2", "acme", 10, 10, reservation.quota)
    assert await control.settle(lost, 0, timeline=never.pending("acme")) is None
    assert (await store.get("req-2", "acme")).finish_reason == "cancelled"
