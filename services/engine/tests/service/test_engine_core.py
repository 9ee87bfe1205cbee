"""EngineCore over the real scheduler with a fake runner: deltas, fan-out, aborts, failures."""

from __future__ import annotations

import pytest

from conveyor.engine.core.errors import DuplicateRequestId, RequestTooLong
from conveyor.engine.core.request import FinishReason
from conveyor.engine.engine_request import EngineRequest
from conveyor.engine.sampling_params import SamplingParams


def _request(request_id, prompt, **params):
    return EngineRequest(request_id, prompt, SamplingParams(temperature=0.0, **params))


def _tokens_by_index(deltas, request_id):
    out = {}
    for delta in deltas:
        if delta.request_id == request_id:
            out.setdefault(delta.index, []).extend(delta.new_token_ids)
    return out


def test_request_streams_tokens_then_finishes_with_length(support):
    core = support.make_core()
    core.add_request(_request("a", [1, 2, 3], max_tokens=4))
    deltas = support.run_to_completion(core)
    assert _tokens_by_index(deltas, "a") == {0: [4, 5, 6, 7]}
    last = deltas[-1]
    assert last.finish_reason is FinishReason.LENGTH
    assert (last.num_prompt_tokens, last.num_output_tokens) == (3, 4)
    assert core.stats().num_free_blocks == core.stats().num_blocks


def test_eos_finishes_with_stop_and_reports_the_stop_token(support):
    core = support.make_core()
    core.runner.eos_after = 2
    core.add_request(_request("a", [1, 2, 3], max_tokens=10))
    deltas = support.run_to_completion(core)
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert deltas[-1].stop_token_id == support.EOS
    assert _tokens_by_index(deltas, "a") == {0: [4, 5, support.EOS]}


def test_logprobs_only_when_asked(support):
    core = support.make_core()
    core.add_request(_request("a", [1, 2], max_tokens=2, logprobs=True, top_logprobs=2))
    core.add_request(_request("b", [1, 2], max_tokens=2))
    deltas = support.run_to_completion(core)
    assert all(d.new_logprobs and d.new_logprobs[0].logprob == -0.25
               for d in deltas if d.request_id == "a")
    assert all(d.new_logprobs is None for d in deltas if d.request_id == "b")


def test_n_samples_fan_out_and_share_the_prompt_blocks(support):
    core = support.make_core(block_size=4)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    core.add_request(_request("p", prompt, n=3, max_tokens=3))
    assert sorted(core.scheduler.requests) == ["p-0"]  # the others wait for the prompt
    deltas = support.run_to_completion(core)
    assert _tokens_by_index(deltas, "p") == {i: [14, 15, 16] for i in range(3)}
    finals = {d.index: d for d in deltas if d.finished}
    assert finals[0].num_cached_tokens == 0
    assert finals[1].num_cached_tokens == finals[2].num_cached_tokens == 12
    assert not core.has_unfinished_requests


def test_n_samples_get_distinct_seeds(support):
    core = support.make_core()
    core.add_request(EngineRequest("p", [1, 2], SamplingParams(n=2, seed=7, max_tokens=1)))
    seeds = [core.scheduler.requests["p-0"].sampling_params.seed]
    support.run_to_completion(core)
    core.add_request(EngineRequest("q", [1, 2], SamplingParams(n=2, seed=7, max_tokens=1)))
    core.step()
    seeds.append(core.scheduler.requests["q-1"].sampling_params.seed)
    assert seeds == [7, 8]


def test_sample_seeds_wrap_at_int64_as_the_gateway_wraps_them(support):
    core = support.make_core()
    core.add_request(EngineRequest("p", [1, 2], SamplingParams(n=2, seed=2**63 - 1,
                                                               max_tokens=5)))
    core.step()  # sample 0 computes the prompt; sample 1 joins
    requests = core.scheduler.requests
    assert [requests[f"p-{i}"].sampling_params.seed for i in (0, 1)] == [2**63 - 1, -(2**63)]


def test_abort_frees_blocks_and_other_requests_continue(support):
    core = support.make_core()
    core.add_request(_request("a", list(range(1, 10)), max_tokens=20))
    core.add_request(_request("b", list(range(20, 30)), max_tokens=5))
    first = core.step()
    core.abort(["a", "unknown"])
    deltas = support.run_to_completion(core)
    assert all(d.request_id == "b" for d in deltas)
    deltas = first + deltas
    assert len(_tokens_by_index(deltas, "b")[0]) == 5
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0


def test_abort_of_a_fanned_out_request_drops_held_samples(support):
    core = support.make_core()
    core.add_request(_request("p", [1, 2, 3, 4, 5], n=4, max_tokens=5))
    core.abort(["p"])
    assert not core.has_unfinished_requests
    assert core.stats().num_waiting == 0


def test_model_failure_fails_that_step_and_the_engine_keeps_serving(support):
    core = support.make_core()
    core.runner.fail_on = 50
    core.add_request(_request("bad", [50, 51], max_tokens=3))
    deltas = core.step()
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("bad", FinishReason.ABORT)]
    assert "injected model failure" in deltas[0].error
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_blocks
    core.add_request(_request("good", [1, 2], max_tokens=2))
    deltas = support.run_to_completion(core)
    assert _tokens_by_index(deltas, "good") == {0: [3, 4]}


def test_bad_requests_are_refused_here_leaving_nothing_behind(support):
    """EngineCore is the one check of a new request (the scheduler only asserts): ids in
    use (a caller's, or a sample's of n > 1), an empty prompt, prompt + max_tokens over
    max_model_len."""
    core = support.make_core(max_model_len=16)
    core.add_request(_request("a", [1, 2], max_tokens=2, n=2))  # samples a-0 and a-1
    refused = [(_request("a", [1, 2], max_tokens=2), DuplicateRequestId, "already running"),
               (_request("a-1", [3], max_tokens=2), DuplicateRequestId, "already running"),
               (_request("b", [], max_tokens=2), ValueError, "empty prompt"),
               (_request("long", list(range(1, 15)), max_tokens=5), RequestTooLong,
                r"14 tokens \+ max_tokens 5 = 19.*max_model_len 16")]
    for request, error, message in refused:
        with pytest.raises(error, match=message):
            core.add_request(request)
    assert core.unfinished_request_ids == ["a"]
    core.add_request(_request("fits", list(range(1, 12)), max_tokens=5))  # exactly 16
    deltas = support.run_to_completion(core)
    assert _tokens_by_index(deltas, "a") == {0: [3, 4], 1: [3, 4]}
    assert len(_tokens_by_index(deltas, "fits")[0]) == 5
    assert core.stats().num_free_blocks == core.stats().num_blocks


def test_iteration_stats_time_each_request(support):
    core = support.make_core()
    results = []
    core.timer.on_iteration = results.append
    core.add_request(_request("a", [1, 2, 3], max_tokens=3))
    while core.has_unfinished_requests:
        core.step()
    assert len(results[0].queue_time) == 1 and len(results[0].time_to_first_token) == 1
    assert results[0].num_prompt_tokens == 3
    assert sum(len(r.inter_token_latency) for r in results) == 2
    assert sum(r.num_generation_tokens for r in results) == 3
    [finished] = results[-1].finished
    assert (finished.finish_reason, finished.num_generation_tokens) == ("length", 3)
    assert finished.e2e_latency >= finished.inference_time > 0


def test_a_failing_request_in_a_batch_fails_alone(support):
    core = support.make_core()
    core.runner.fail_on = 50
    core.add_request(_request("good", [1, 2], max_tokens=3))
    core.add_request(_request("bad", [50, 51], max_tokens=3))
    first = core.step()
    assert sorted((d.request_id, d.error is not None) for d in first) == [("bad", True),
                                                                           ("good", False)]
    deltas = first + support.run_to_completion(core)
    assert _tokens_by_index(deltas, "good") == {0: [3, 4, 5]}
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_blocks


def _prompt_logprob_deltas(deltas, request_id):
    return [d for d in deltas if d.request_id == request_id and d.prompt_logprobs]


def test_prompt_logprobs_come_once_with_the_first_token_over_every_prefill_chunk(support):
    core = support.make_core(max_num_batched_tokens=5)  # a 12-token prompt in 3 chunks
    prompt = list(range(10, 22))
    core.add_request(_request("a", prompt, max_tokens=3, prompt_logprobs=1))
    deltas = support.run_to_completion(core)
    [carrier] = _prompt_logprob_deltas(deltas, "a")
    assert carrier.new_token_ids == [22]  # the request's first token
    assert [entry.rank for entry in carrier.prompt_logprobs] == list(range(1, 12))
    assert [entry.logprob for entry in carrier.prompt_logprobs] == [-t / 100 for t in prompt[1:]]


def test_a_prompt_logprobs_request_reads_no_cached_block_but_caches_its_own(support):
    core = support.make_core()
    prompt = list(range(10, 22))
    core.add_request(_request("warm", prompt, max_tokens=2))
    support.run_to_completion(core)
    core.add_request(_request("asks", prompt, max_tokens=2, prompt_logprobs=0))
    asks = support.run_to_completion(core)
    assert asks[-1].num_cached_tokens == 0
    assert len(_prompt_logprob_deltas(asks, "asks")[0].prompt_logprobs) == len(prompt) - 1
    core.add_request(_request("plain", prompt, max_tokens=2))
    assert support.run_to_completion(core)[-1].num_cached_tokens == 8  # two full blocks


def test_only_the_first_sample_carries_prompt_logprobs(support):
    core = support.make_core()
    core.add_request(_request("n", list(range(10, 22)), max_tokens=2, n=3, prompt_logprobs=0))
    deltas = support.run_to_completion(core)
    assert [d.index for d in _prompt_logprob_deltas(deltas, "n")] == [0]
