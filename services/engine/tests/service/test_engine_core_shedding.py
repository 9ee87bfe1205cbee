"""EngineCore over a bounded waiting queue: pushed-out caller requests, n > 1, Stats, settings."""

from __future__ import annotations

import pytest

from conveyor.engine.core.errors import WaitingQueueFull
from conveyor.engine.engine_factory import engine_config, resolved_config
from conveyor.engine.engine_request import EngineRequest
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.settings import EngineSettings


def _request(request_id, prompt, priority=0, **params):
    return EngineRequest(request_id, prompt, SamplingParams(temperature=0.0, **params),
                         priority=priority)


def _finished(deltas) -> set[str]:
    return {delta.request_id for delta in deltas if delta.finished}


def test_a_pushed_out_request_is_returned_with_its_error_and_forgotten(support):
    core = support.make_core(max_num_seqs=1, max_num_waiting_seqs=1)
    core.add_request(_request("run", [1, 2, 3], max_tokens=4))
    core.step()
    assert core.add_request(_request("low", [5, 6, 7, 8, 9], priority=1, n=2)) == {}
    assert core.stats().num_waiting == 2  # low-0 queued, low-1 held until low-0's prefill
    pushed_out = core.add_request(_request("high", [7, 8], max_tokens=2))
    assert list(pushed_out) == ["low"]
    error = pushed_out["low"]
    assert isinstance(error, WaitingQueueFull) and error.pushed_out
    assert str(error) == ("pushed out by a higher-priority request: the engine's waiting queue "
                          "is full (1 requests / unlimited tokens); retry later")
    assert core.unfinished_request_ids == ["run", "high"]
    assert core._num_held_siblings == 0 and set(core.scheduler.requests) == {"run", "high"}
    assert set(core.scheduler.requests) == {"run", "high"}
    assert _finished(support.run_to_completion(core)) == {"run", "high"}
    stats = core.stats()
    assert (stats.num_requests_shed, stats.num_waiting, stats.num_waiting_tokens) == (1, 0, 0)
    assert stats.num_free_blocks == stats.num_blocks


def test_a_refused_request_leaves_nothing_behind(support):
    core = support.make_core(max_num_seqs=1, max_num_waiting_seqs=1)
    core.add_request(_request("a", [1, 2, 3]))
    with pytest.raises(WaitingQueueFull):
        core.add_request(_request("b", [4, 5, 6], n=3))
    assert core.unfinished_request_ids == ["a"] and core._num_held_siblings == 0
    assert list(core.add_request(_request("b", [4, 5, 6], priority=-1))) == ["a"]
    assert core.unfinished_request_ids == ["b"]  # b's id was free again


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_other_samples_of_an_admitted_request_join_past_the_bounds(support, prefix_caching):
    core = support.make_core(max_num_seqs=1, max_num_waiting_seqs=1,
                             enable_prefix_caching=prefix_caching)
    core.add_request(_request("a", [1, 2, 3, 4, 5], max_tokens=3, n=3))
    deltas = support.run_to_completion(core)
    assert {d.index for d in deltas if d.finished} == {0, 1, 2}
    assert core.stats().num_requests_shed == 0


def test_stats_report_the_bounds_and_the_waiting_tokens(support):
    core = support.make_core(max_num_seqs=1, max_num_waiting_seqs=4, max_num_waiting_tokens=200)
    for name, prompt in [("a", [1, 2, 3]), ("b", [4, 5, 6, 7]), ("c", [8] * 9)]:
        core.add_request(_request(name, prompt))
    stats = core.stats()
    assert (stats.max_num_waiting_seqs, stats.max_num_waiting_tokens) == (4, 200)
    assert (stats.num_waiting, stats.num_waiting_tokens) == (3, 16)
    core.step()  # a runs
    assert (core.stats().num_waiting, core.stats().num_waiting_tokens) == (2, 13)
    unbounded = support.make_core().stats()
    assert (unbounded.max_num_waiting_seqs, unbounded.max_num_waiting_tokens) == (0, 0)


def _resolved(settings: EngineSettings, max_model_len: int):
    return resolved_config(settings, engine_config(settings), max_model_len, num_blocks=4096)


@pytest.mark.parametrize(("env", "max_model_len", "expected"), [
    ({}, 8192, (256, 16384)),  # 8 x max_num_batched_tokens (2048)
    ({}, 32768, (256, 32768)),  # at least max_model_len
    ({"MAX_NUM_BATCHED_TOKENS": "512"}, 2048, (256, 4096)),
    ({"MAX_NUM_WAITING_SEQS": "0", "MAX_NUM_WAITING_TOKENS": "0"}, 2048, (None, None)),
    ({"MAX_NUM_WAITING_SEQS": "8", "MAX_NUM_WAITING_TOKENS": "3000"}, 2048, (8, 3000)),
])
def test_settings_reach_the_scheduler_config(monkeypatch, env, max_model_len, expected):
    for name, value in env.items():
        monkeypatch.setenv(f"CONVEYOR_ENGINE_{name}", value)
    config = _resolved(EngineSettings(), max_model_len)
    assert (config.max_num_waiting_seqs, config.max_num_waiting_tokens) == expected


def test_the_offline_llm_queues_every_prompt_unless_told_otherwise():
    from conveyor.engine.llm import UNBOUNDED_WAITING

    config = _resolved(EngineSettings(**UNBOUNDED_WAITING), 2048)
    assert (config.max_num_waiting_seqs, config.max_num_waiting_tokens) == (None, None)
