"""A request resumed after its first engine failed (resume_output_token_ids): the engine
continues after the output it is given, counts it against max_tokens, streams only the
new tokens, and refuses output it cannot continue."""

from __future__ import annotations

import pytest

from conveyor.engine.core.request import FinishReason
from conveyor.engine.engine_request import EngineRequest
from conveyor.engine.request_validation import InvalidRequestError, validate_request
from conveyor.engine.sampling_params import SamplingParams


def _resumed(prompt, produced, **params):
    return EngineRequest("r", prompt, SamplingParams(temperature=0.0, **params),
                         output_token_ids=produced)


def test_a_resumed_request_streams_only_what_follows_its_output(support):
    core = support.make_core()
    core.add_request(_resumed([1, 2, 3], [4, 5], max_tokens=4))
    deltas = support.run_to_completion(core)
    assert [t for d in deltas for t in d.new_token_ids] == [6, 7]  # 4, 5 came before
    last = deltas[-1]
    assert last.finish_reason is FinishReason.LENGTH
    assert (last.num_prompt_tokens, last.num_output_tokens) == (3, 4)
    assert core.stats().num_free_blocks == core.stats().num_blocks


def test_it_continues_exactly_where_an_uninterrupted_run_would_be(support):
    whole = support.make_core()
    whole.add_request(EngineRequest("w", [7, 8, 9], SamplingParams(temperature=0.0,
                                                                   max_tokens=6)))
    tokens = [t for d in support.run_to_completion(whole) for t in d.new_token_ids]
    resumed = support.make_core()
    resumed.add_request(_resumed([7, 8, 9], tokens[:2], max_tokens=6))
    assert [t for d in support.run_to_completion(resumed) for t in d.new_token_ids] == tokens[2:]


@pytest.mark.parametrize(("produced", "params", "message"), [
    ([5, 10**6], {"max_tokens": 8}, "out of range for the vocabulary"),
    ([5, 6, 7], {"max_tokens": 3}, "already reach max_tokens 3"),
    ([5], {"max_tokens": 4, "n": 2}, "needs n = 1"),
])
def test_output_it_cannot_continue_is_refused(support, produced, params, message):
    request = _resumed([1, 2], produced, **params)
    with pytest.raises(InvalidRequestError, match=message):
        validate_request(request, support.make_core().info)
