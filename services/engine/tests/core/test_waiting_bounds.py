"""The bounded waiting queue: who is refused, who is pushed out, and that nothing is left behind."""

from __future__ import annotations

import pytest

from conveyor.engine.core.config import EngineConfig
from conveyor.engine.core.errors import InvalidEngineConfig, WaitingQueueFull
from conveyor.engine.core.request import FinishReason, RequestStatus


def waiting_ids(sched) -> list[str]:
    return [r.request_id for r in sched.waiting]


def add(support, sched, name, prompt_len=4, priority=0, exempt=False):
    request = support.make_request(name, range(100, 100 + prompt_len), max_tokens=1,
                                   priority=priority)
    request.exempt_from_bounds = exempt
    shed = sched.add_request(request)
    support.check_invariants(sched)
    return [r.request_id for r in shed]


def test_arrivals_within_the_bounds_all_wait(support):
    sched = support.make_scheduler(max_num_waiting_seqs=3, max_num_waiting_tokens=40)
    assert [add(support, sched, n, prompt_len=5) for n in "abc"] == [[], [], []]
    assert waiting_ids(sched) == ["a", "b", "c"]
    assert (sched.stats.num_waiting_tokens, sched.stats.num_requests_shed) == (15, 0)


def test_an_arrival_tying_with_the_lowest_priority_is_refused_and_nothing_changes(support):
    sched = support.make_scheduler(max_num_waiting_seqs=2)
    add(support, sched, "a", priority=1)
    add(support, sched, "b", priority=1)
    for name, priority in [("tie", 1), ("lower", 2)]:
        with pytest.raises(WaitingQueueFull) as caught:
            add(support, sched, name, priority=priority)
        assert str(caught.value) == (
            "the engine's waiting queue is full (2 requests / unlimited tokens); retry later")
        assert not caught.value.pushed_out and name not in sched.requests
    assert waiting_ids(sched) == ["a", "b"] and sched.num_requests_shed == 2


def test_a_higher_priority_arrival_pushes_out_the_lowest_latest_waiting_request(support):
    sched = support.make_scheduler(max_num_waiting_seqs=3)
    for name, priority in [("a", 1), ("b", 2), ("c", 2)]:
        add(support, sched, name, priority=priority)
    c = sched.requests["c"]
    assert add(support, sched, "h1", priority=0) == ["c"]
    assert waiting_ids(sched) == ["h1", "a", "b"]
    assert c.status is RequestStatus.FINISHED and c.finish_reason is FinishReason.QUEUE_FULL
    assert add(support, sched, "h2", priority=0) == ["b"]
    assert add(support, sched, "h3", priority=0) == ["a"]
    with pytest.raises(WaitingQueueFull):  # h1, h2 rank above it: nobody ranks below
        add(support, sched, "h4", priority=0)
    assert waiting_ids(sched) == ["h1", "h2", "h3"] and sched.num_requests_shed == 4
    assert sched.schedule().finished_request_ids == ["c", "b", "a"]  # the runner forgets them


def test_the_token_bound_pushes_out_as_many_as_it_takes(support):
    sched = support.make_scheduler(max_model_len=32, max_num_waiting_tokens=32)
    for name, priority in [("a", 1), ("b", 1), ("c", 2), ("d", 2)]:
        add(support, sched, name, prompt_len=8, priority=priority)
    assert add(support, sched, "big", prompt_len=20, priority=0) == ["d", "c", "b"]
    assert waiting_ids(sched) == ["big", "a"] and sched.waiting.num_tokens == 28


def test_when_pushing_out_every_lower_request_is_not_enough_nobody_is_pushed_out(support):
    sched = support.make_scheduler(max_model_len=32, max_num_waiting_tokens=32)
    add(support, sched, "a", prompt_len=16, priority=0)
    add(support, sched, "b", prompt_len=8, priority=2)
    add(support, sched, "c", prompt_len=8, priority=2)
    with pytest.raises(WaitingQueueFull):  # b and c free 16 of the 20 tokens it needs
        add(support, sched, "big", prompt_len=20, priority=1)
    assert waiting_ids(sched) == ["a", "b", "c"] and sched.waiting.num_tokens == 32


def test_a_running_request_is_never_pushed_out_and_a_pushed_out_one_holds_no_blocks(support):
    sched = support.make_scheduler(num_blocks=10, block_size=4, max_num_seqs=1,
                                   max_num_waiting_seqs=1)
    runner = support.FakeRunner()
    sched.add_request(support.make_request("warm", range(8), max_tokens=1))
    support.run_until_done(sched, runner)  # blocks 0 and 1 now cached, free
    sched.add_request(support.make_request("run", range(50, 54), max_tokens=8, priority=5))
    support.step(sched, runner)
    cached = dict(sched.kv.pool.cached_blocks)
    hit = support.make_request("hit", [*range(8), 9], priority=3)
    sched.add_request(hit)
    free_before = sched.kv.pool.free_queue.block_ids()
    assert add(support, sched, "urgent", priority=0) == ["hit"]  # not "run", though lowest
    assert sched.running == [sched.requests["run"]] and waiting_ids(sched) == ["urgent"]
    assert sched.kv.pool.free_queue.block_ids() == free_before
    assert sched.kv.pool.cached_blocks == cached and hit.block_ids is None
    results = support.run_until_done(sched, runner)
    assert set(results) == {"run", "urgent"} and sched.kv.num_free_blocks == 10


def test_a_preempted_request_counts_but_keeps_its_place(support):
    sched = support.make_scheduler(num_blocks=6, block_size=4, max_model_len=24,
                                   max_num_waiting_seqs=2)
    runner = support.FakeRunner()
    for i, name in enumerate("abc"):
        sched.add_request(support.make_request(name, range(10 * i, 10 * i + 4), max_tokens=8,
                                               priority=1))
        support.step(sched, runner)
    while not sched.waiting:
        support.step(sched, runner)
    [preempted] = sched.waiting
    assert preempted.status is RequestStatus.PREEMPTED
    assert sched.waiting.num_tokens == preempted.num_tokens > 4
    add(support, sched, "d", priority=1)
    assert add(support, sched, "h1", priority=0) == ["d"]
    with pytest.raises(WaitingQueueFull):
        add(support, sched, "h2", priority=0)
    assert waiting_ids(sched) == ["h1", preempted.request_id]


def test_later_samples_join_past_the_bounds_and_are_never_pushed_out(support):
    sched = support.make_scheduler(max_num_waiting_seqs=1)
    add(support, sched, "a-0", priority=1)
    assert add(support, sched, "a-1", priority=1, exempt=True) == []
    for name, priority in [("tie", 1), ("urgent", 0)]:  # a-1 counts, and stays
        with pytest.raises(WaitingQueueFull):
            add(support, sched, name, priority=priority)
    assert waiting_ids(sched) == ["a-0", "a-1"]


@pytest.mark.parametrize(("bounds", "message"), [
    ({"max_num_waiting_seqs": 0}, "max_num_waiting_seqs must be None or at least 1, got 0"),
    ({"max_num_waiting_tokens": 0}, "max_num_waiting_tokens must be None or at least 1, got 0"),
    ({"max_num_waiting_tokens": 63},
     "max_num_waiting_tokens (63) must be at least max_model_len (64), or a long prompt could "
     "never be queued; raise CONVEYOR_ENGINE_MAX_NUM_WAITING_TOKENS (0: no limit)"),
])
def test_bad_bounds_are_refused_at_start_naming_the_setting(bounds, message):
    with pytest.raises(InvalidEngineConfig) as caught:
        EngineConfig(num_blocks=16, block_size=4, max_model_len=64, **bounds)
    assert str(caught.value) == message
