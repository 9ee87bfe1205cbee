"""The scheduler on tiny pools: batching, chunking, priority, preemption, abort, finishing."""

from __future__ import annotations

import pytest

from conveyor.engine.core.config import EngineConfig
from conveyor.engine.core.errors import (
    InvalidEngineConfig,
    KVCacheTooSmall,
)
from conveyor.engine.core.request import FinishReason, Request, RequestStatus
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.core.scheduler_output import ModelRunnerOutput
from conveyor.engine.core.stop_check import check_finished
from conveyor.engine.sampling_params import SamplingParams


def batch_of(output) -> dict[str, int]:
    """request id -> tokens scheduled, in batch order."""
    return {s.request_id: len(s.token_ids) for s in output.scheduled}


# -- continuous batching and chunked prefill ---------------------------------------------


def test_a_request_joins_at_the_next_step_and_leaves_in_the_step_it_finishes(support):
    sched = support.make_scheduler(num_blocks=10, block_size=4)
    runner = support.FakeRunner()
    a = support.make_request("a", range(6), max_tokens=2)
    sched.add_request(a)
    output, updates = support.step(sched, runner)
    assert batch_of(output) == {"a": 6} and output.block_size == 4
    assert [u.request_id for u in updates] == ["a"] and not updates[0].finished

    sched.add_request(support.make_request("b", range(10, 15), max_tokens=3))
    output, updates = support.step(sched, runner)
    assert batch_of(output) == {"a": 1, "b": 5}
    assert updates[0].finish_reason is FinishReason.LENGTH
    assert updates[0].num_output_tokens == 2 and updates[0].num_prompt_tokens == 6
    assert sched.running == [sched.requests["b"]] and "a" not in sched.requests
    assert a.block_ids is None and sched.kv.num_free_blocks == 10 - 2

    output, _ = support.step(sched, runner)
    assert batch_of(output) == {"b": 1} and output.finished_request_ids == ["a"]


def test_the_scheduler_output_describes_the_step(support):
    sched = support.make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=5)
    sched.add_request(support.make_request("a", range(100, 107)))
    output = sched.schedule()
    first = output.scheduled[0]
    assert first.token_ids == [100, 101, 102, 103, 104]
    assert (first.num_computed_tokens, first.seq_len) == (0, 5)
    assert first.block_table == [0, 1] and first.slot_mapping == [0, 1, 2, 3, 4]
    assert not first.needs_sample
    assert sched.update_from_output(output, ModelRunnerOutput()) == []
    second = sched.schedule().scheduled[0]
    assert second.token_ids == [105, 106] and second.num_computed_tokens == 5
    assert second.slot_mapping == [5, 6] and second.needs_sample


def test_chunked_prefill_shares_the_token_budget_with_decode(support):
    sched = support.make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    runner = support.FakeRunner()
    sched.add_request(support.make_request("a", range(20), max_tokens=4))
    sched.add_request(support.make_request("b", range(30, 36), max_tokens=4))
    steps = [batch_of(support.step(sched, runner)[0]) for _ in range(5)]
    assert steps == [
        {"a": 8},
        {"a": 8},
        {"a": 4, "b": 4},
        {"a": 1, "b": 2},
        {"a": 1, "b": 1},
    ]


def test_long_prefill_token_threshold_caps_one_request_per_step(support):
    sched = support.make_scheduler(
        num_blocks=16, block_size=4, max_num_batched_tokens=32, long_prefill_token_threshold=4
    )
    runner = support.FakeRunner()
    sched.add_request(support.make_request("a", range(10)))
    sched.add_request(support.make_request("b", range(20, 26)))
    steps = [batch_of(support.step(sched, runner)[0]) for _ in range(3)]
    assert steps == [{"a": 4, "b": 4}, {"a": 4, "b": 2}, {"a": 2, "b": 1}]


def test_max_num_seqs_caps_the_batch(support):
    sched = support.make_scheduler(num_blocks=16, block_size=4, max_num_seqs=2)
    runner = support.FakeRunner()
    for name in "abc":
        sched.add_request(support.make_request(name, range(4), max_tokens=2))
    assert list(batch_of(support.step(sched, runner)[0])) == ["a", "b"]
    assert list(batch_of(support.step(sched, runner)[0])) == ["a", "b"]
    assert list(batch_of(support.step(sched, runner)[0])) == ["c"]


# -- priority ------------------------------------------------------------------------------


def test_waiting_requests_are_admitted_by_priority_then_arrival(support):
    sched = support.make_scheduler(num_blocks=10, block_size=4, max_num_seqs=1)
    runner = support.FakeRunner()
    for name, priority in [("c", 1), ("a1", 0), ("a2", 0), ("urgent", -1)]:
        sched.add_request(support.make_request(name, range(4), max_tokens=1, priority=priority))
    assert [r.request_id for r in sched.waiting] == ["urgent", "a1", "a2", "c"]
    order = [next(iter(batch_of(support.step(sched, runner)[0]))) for _ in range(4)]
    assert order == ["urgent", "a1", "a2", "c"]


def test_higher_priority_request_preempts_at_max_num_seqs(support):
    sched = support.make_scheduler(num_blocks=16, block_size=4, max_num_seqs=2)
    runner = support.FakeRunner()
    sched.add_request(support.make_request("low1", range(4), max_tokens=6, priority=1))
    sched.add_request(support.make_request("low2", range(4), max_tokens=6, priority=1))
    support.step(sched, runner)
    sched.add_request(support.make_request("peer", range(8), max_tokens=2, priority=1))
    output, _ = support.step(sched, runner)  # same priority: nobody is displaced
    assert output.preempted_request_ids == [] and "peer" not in batch_of(output)

    sched.add_request(support.make_request("high", range(50, 58), max_tokens=2, priority=0))
    output, _ = support.step(sched, runner)
    assert output.preempted_request_ids == ["low2"]  # lowest priority, latest admitted
    assert batch_of(output) == {"low1": 1, "high": 8}
    assert [r.request_id for r in sched.waiting] == ["low2", "peer"]  # original arrival order
    results = support.run_until_done(sched, runner)
    assert sched.num_preemptions == 1  # no ping-pong afterwards
    assert set(results) == {"low1", "low2", "peer", "high"}


def test_no_preemption_when_it_would_not_make_room(support):
    sched = support.make_scheduler(num_blocks=6, block_size=4, max_num_seqs=2, max_model_len=24)
    runner = support.FakeRunner()
    sched.add_request(support.make_request("big", range(12), max_tokens=3, priority=0))
    sched.add_request(support.make_request("small", range(50, 53), max_tokens=8, priority=2))
    support.step(sched, runner)  # big holds 3 blocks, small 1
    sched.add_request(support.make_request("mid", range(100, 116), max_tokens=1, priority=1))
    output, _ = support.step(sched, runner)
    # mid needs 4 blocks; preempting small would free 1 (1 is free): nobody is preempted.
    assert batch_of(output) == {"big": 1, "small": 1}
    assert output.preempted_request_ids == []
    support.step(sched, runner)  # big finishes and frees 4 blocks
    output, _ = support.step(sched, runner)
    assert batch_of(output) == {"small": 1, "mid": 16} and sched.num_preemptions == 0


def test_higher_priority_request_preempts_for_blocks_when_that_is_enough(support):
    sched = support.make_scheduler(num_blocks=6, block_size=4, max_model_len=24)
    runner = support.FakeRunner()
    sched.add_request(support.make_request("low", range(20), max_tokens=4, priority=5))
    support.step(sched, runner)  # low holds 6 blocks
    sched.add_request(support.make_request("high", range(50, 58), max_tokens=1, priority=0))
    output, _ = support.step(sched, runner)
    assert output.preempted_request_ids == ["low"] and batch_of(output) == {"high": 8}
    results = support.run_until_done(sched, runner)
    assert results["low"][1] is FinishReason.LENGTH and len(results["low"][0]) == 3


# -- preemption by recompute -----------------------------------------------------------------


def test_pool_pressure_preempts_the_latest_admitted_request(support):
    sched = support.make_scheduler(num_blocks=6, block_size=4, max_model_len=24)
    runner = support.FakeRunner()
    for i, name in enumerate("abc"):
        sched.add_request(support.make_request(name, range(10 * i, 10 * i + 4), max_tokens=8))
    outputs = [support.step(sched, runner)[0] for _ in range(6)]  # the 6th step needs 3 blocks
    assert [o.preempted_request_ids for o in outputs] == [[], [], [], [], [], ["c"]]
    assert batch_of(outputs[-1]) == {"a": 1, "b": 1}
    c = sched.requests["c"]
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_output_tokens == 5 and c.block_ids is None
    sched.add_request(support.make_request("d", range(4), max_tokens=1))
    assert [r.request_id for r in sched.waiting] == ["c", "d"]


def test_the_lowest_priority_request_is_the_victim_even_if_admitted_first(support):
    sched = support.make_scheduler(num_blocks=6, block_size=4, max_model_len=24)
    runner = support.FakeRunner()
    sched.add_request(support.make_request("a", range(4), max_tokens=8, priority=1))
    sched.add_request(support.make_request("b", range(10, 14), max_tokens=8))
    sched.add_request(support.make_request("c", range(20, 24), max_tokens=8))
    outputs = [support.step(sched, runner)[0] for _ in range(6)]
    assert outputs[-1].preempted_request_ids == ["a"]  # a needed the block, and was the victim
    assert batch_of(outputs[-1]) == {"b": 1, "c": 1}


def test_preemption_and_resumption_give_the_same_tokens(support):
    def run(num_blocks: int) -> tuple[dict, int]:
        sched = support.make_scheduler(num_blocks=num_blocks, block_size=4, max_model_len=32)
        for i in range(6):
            prompt = [i, 7, 7, i + 1, 9, i]  # shared and private blocks
            sched.add_request(support.make_request(f"r{i}", prompt, max_tokens=14 + i % 3))
        return support.run_until_done(sched, support.FakeRunner(vocab_size=50)), sched

    reference, big = run(num_blocks=64)
    preempted, small = run(num_blocks=8)
    assert big.num_preemptions == 0 and small.num_preemptions > 0
    assert preempted == reference
    assert small.kv.num_free_blocks == 8


def test_resumed_request_hits_its_own_cached_blocks(support):
    sched = support.make_scheduler(num_blocks=7, block_size=4, max_model_len=24)
    runner = support.FakeRunner()
    for i, name in enumerate("abc"):  # blocks 0, 1, 2 then 3, 4, 5
        sched.add_request(support.make_request(name, range(10 * i, 10 * i + 4), max_tokens=8))
    outputs = [support.step(sched, runner)[0] for _ in range(6)]
    assert outputs[-1].preempted_request_ids == ["c"]
    # a took block 6; c freed 5 then 2 (tail first); b took 5; c's prompt block 2 survives.
    assert sched.requests["a"].block_ids[-1] == 6 and sched.requests["b"].block_ids[-1] == 5
    c = sched.requests["c"]
    hits, num_hit_tokens = sched.kv.get_computed_blocks(c)
    assert [block.block_id for block in hits] == [2] and num_hit_tokens == 4
    assert c.num_cached_tokens == 0  # usage reports the first admission
    results = support.run_until_done(sched, runner)
    assert len(results["c"][0]) == 3  # 8 tokens in all; 5 came before the preemption


# -- abort -----------------------------------------------------------------------------------


def test_abort_a_waiting_request(support):
    sched = support.make_scheduler()
    sched.add_request(support.make_request("a", range(4)))
    assert sched.abort("a") is True
    assert sched.abort("a") is False and sched.abort("never-added") is False
    assert sched.num_waiting == 0 and not sched.has_unfinished_requests
    output = sched.schedule()
    assert output.is_empty and output.finished_request_ids == ["a"]


def test_abort_a_running_request_between_steps_frees_blocks_at_once(support):
    sched = support.make_scheduler(num_blocks=10, block_size=4)
    runner = support.FakeRunner()
    sched.add_request(support.make_request("a", range(6)))
    support.step(sched, runner)
    assert sched.kv.num_free_blocks == 8
    assert sched.abort("a") and sched.abort("a") is False
    assert sched.kv.num_free_blocks == 10 and sched.running == []
    support.check_invariants(sched)


def test_abort_during_a_step_frees_blocks_at_the_step_boundary(support):
    sched = support.make_scheduler(num_blocks=10, block_size=4)
    runner = support.FakeRunner()
    a = support.make_request("a", range(6))
    sched.add_request(a)
    sched.add_request(support.make_request("b", range(6)))
    output = sched.schedule()
    assert sched.abort("a")
    assert a.block_ids == [0, 1]  # the runner may still write them
    support.check_invariants(sched)
    updates = sched.update_from_output(output, runner.execute(output))
    assert [u.request_id for u in updates] == ["b"]  # a's token is dropped
    assert a.block_ids is None and sched.kv.num_free_blocks == 8
    support.check_invariants(sched)
    assert sched.schedule().finished_request_ids == ["a"]


def test_abort_during_a_chunked_prefill(support):
    sched = support.make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=4)
    runner = support.FakeRunner()
    sched.add_request(support.make_request("a", range(12)))
    output, updates = support.step(sched, runner)
    assert batch_of(output) == {"a": 4} and updates == []
    assert sched.abort("a") and sched.kv.num_free_blocks == 10


def test_abort_a_preempted_request(support):
    sched = support.make_scheduler(num_blocks=6, block_size=4, max_model_len=24)
    runner = support.FakeRunner()
    for i, name in enumerate("abc"):
        sched.add_request(support.make_request(name, range(10 * i, 10 * i + 4), max_tokens=8))
    for _ in range(6):
        support.step(sched, runner)
    assert sched.requests["c"].status is RequestStatus.PREEMPTED
    assert sched.abort("c") and sched.num_waiting == 0
    support.check_invariants(sched)
    support.run_until_done(sched, runner)
    assert sched.kv.num_free_blocks == 6


def test_abort_after_finishing_is_a_no_op(support):
    sched = support.make_scheduler()
    sched.add_request(support.make_request("a", range(4), max_tokens=1))
    support.run_until_done(sched, support.FakeRunner())
    assert sched.abort("a") is False


# -- finishing -------------------------------------------------------------------------------


def run_scripted(support, script, eos=(2,), **params) -> tuple[list[int], FinishReason]:
    sched = support.make_scheduler(num_blocks=10, block_size=4, eos=eos)
    sched.add_request(support.make_request("a", range(4), **params))
    results = support.run_until_done(sched, support.ScriptedRunner({"a": script}))
    return results["a"][0], results["a"][1]


def test_eos_stops_with_reason_stop(support):
    assert run_scripted(support, [5, 6, 2, 7]) == ([5, 6, 2], FinishReason.STOP)


def test_eos_before_min_tokens_does_not_stop(support):
    assert run_scripted(support, [2, 2, 2, 7], min_tokens=3) == ([2, 2, 2], FinishReason.STOP)
    assert run_scripted(support, [2, 5, 6, 2], min_tokens=3) == ([2, 5, 6, 2], FinishReason.STOP)


def test_ignore_eos_runs_to_max_tokens(support):
    assert run_scripted(support, [2, 2, 2], max_tokens=3, ignore_eos=True) == (
        [2, 2, 2],
        FinishReason.LENGTH,
    )


def test_stop_token_ids_stop(support):
    assert run_scripted(support, [5, 9, 6], stop_token_ids=[9]) == ([5, 9], FinishReason.STOP)


def test_max_tokens_stops_with_reason_length(support):
    assert run_scripted(support, [5, 6, 7, 8], max_tokens=3) == ([5, 6, 7], FinishReason.LENGTH)


def test_eos_on_the_last_allowed_token_reports_stop(support):
    assert run_scripted(support, [5, 2], max_tokens=2) == ([5, 2], FinishReason.STOP)


def test_max_model_len_stops_with_reason_length():
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=100), output_token_ids=[4, 5])
    assert check_finished(request, frozenset(), max_model_len=5) is FinishReason.LENGTH
    assert check_finished(request, frozenset(), max_model_len=6) is None


def test_updates_carry_logprobs_and_cached_tokens(support):
    sched = support.make_scheduler(num_blocks=10, block_size=4)
    runner = support.FakeRunner()
    sched.add_request(support.make_request("a", range(9), max_tokens=1))
    support.run_until_done(sched, runner)
    sched.add_request(support.make_request("b", range(9), max_tokens=2, logprobs=True))
    _, updates = support.step(sched, runner)
    assert updates[0].num_cached_tokens == 8 and updates[0].new_logprobs[0].logprob == -0.5
    assert updates[0].new_token_ids == [support.next_token(list(range(9)), 64)]
    assert sched.stats.num_prefix_hit_tokens == 8 and sched.stats.num_prefix_query_tokens == 18


# -- limits ----------------------------------------------------------------------------------


def test_an_engine_whose_pool_cannot_hold_one_sequence_refuses_to_start():
    expected = r"2032 tokens.*max_model_len=2048.*increase kv_cache_gib.*lower max_model_len"
    with pytest.raises(KVCacheTooSmall, match=expected):
        Scheduler(EngineConfig(num_blocks=127, block_size=16, max_model_len=2048))
    EngineConfig(num_blocks=128, block_size=16, max_model_len=2048)  # exactly one fits


def test_config_errors_name_the_setting():
    with pytest.raises(InvalidEngineConfig, match="max_num_seqs"):
        EngineConfig(num_blocks=10, max_num_seqs=0, max_model_len=16)
    with pytest.raises(InvalidEngineConfig, match="long_prefill_token_threshold"):
        EngineConfig(num_blocks=10, max_model_len=16, long_prefill_token_threshold=0)
