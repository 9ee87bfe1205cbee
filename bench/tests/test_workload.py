"""Prompts have exact token lengths under the bundled model's tokenizer; every system gets the
same prompts for a scenario."""

import pytest

from bench.serving.workload import FULL, PromptMaker, scenario_requests


def test_random_prompts_encode_to_their_stated_length(maker):
    for request in maker.random_requests(20, input_len=256, output_len=8, range_ratio=0.5):
        assert maker.count(request.prompt) == request.prompt_len
        assert 128 <= request.prompt_len <= 384


def test_shared_prefix_prompts_share_exactly_the_prefix(maker):
    requests = maker.shared_prefix_requests(4, prefix_len=1000, question_len=24, output_len=8,
                                            as_ids=True)
    prefixes = {tuple(r.prompt[:1000]) for r in requests}
    questions = {tuple(r.prompt[1000:]) for r in requests}
    assert len(prefixes) == 1 and len(questions) == 4
    text = maker.text(requests[0].prompt)
    assert maker.count(text) == 1024


def test_fixed_prompts_repeat(maker):
    requests = maker.fixed_requests(3, 50, 5)
    assert len({r.prompt for r in requests}) == 1 and requests[0].prompt_len == 50


def test_mixed_requests_are_exact_and_spread_over_the_ranges(maker):
    requests = maker.mixed_requests(200, (16, 1024), (8, 256))
    lengths = sorted(r.prompt_len for r in requests)
    assert all(16 <= r.prompt_len <= 1024 and 8 <= r.max_tokens <= 256 for r in requests)
    assert lengths[100] < 200 < lengths[-1]  # log-uniform: median ~128, a long tail
    for r in requests[:5]:
        assert maker.count(r.prompt) == r.prompt_len
    with pytest.raises(ValueError, match="low <= high"):
        maker.mixed_requests(1, (10, 5), (1, 2))


def test_every_system_gets_the_same_prompts(maker):
    scenario = FULL.scenario("c16-prefix")
    first = scenario_requests(maker, FULL, scenario, seed=2)
    again = scenario_requests(PromptMaker(maker.tokenizer, seed=7), FULL, scenario, seed=2)
    assert [r.prompt for r in first] == [r.prompt for r in again]
    assert len(first) == scenario.num_requests + 1  # the warm-up request first
    assert all(r.prompt_len == 512 + 256 and r.max_tokens == 64 for r in first)
    assert len({r.prompt[:200] for r in first}) == 1  # one shared system prompt
    cold = scenario_requests(maker, FULL, FULL.scenario("c1-prefix-cold"), seed=2)
    assert len({r.prompt[:200] for r in cold}) == len(cold)  # each request its own


def test_a_sampled_scenario_samples_on_every_path(maker):
    from bench.inprocess_engine import _engine_request
    from bench.serving.client import completion_body

    sampled = scenario_requests(maker, FULL, FULL.scenario("c16-sampled"), seed=0)
    greedy = scenario_requests(maker, FULL, FULL.scenario("c16"), seed=0)
    assert completion_body(sampled[0], "m")["temperature"] == 1.0
    assert completion_body(greedy[0], "m")["temperature"] == 0.0
    engine_request = _engine_request("r", sampled[0], maker.tokenizer, ignore_eos=True)
    assert engine_request.sampling_params.temperature == 1.0
