"""Prompts have exact token lengths under the bundled model's tokenizer."""

import pytest

from bench.serving.workload import PromptMaker, load_prompt_maker


@pytest.fixture(scope="module")
def maker() -> PromptMaker:
    return load_prompt_maker(seed=3)


def test_random_prompts_encode_to_their_stated_length(maker):
    for request in maker.random_requests(20, input_len=256, output_len=8, range_ratio=0.5):
        assert maker.count(request.prompt) == request.prompt_len
        assert 128 <= request.prompt_len <= 384


def test_token_id_prompts(maker):
    request = maker.random_requests(1, 100, 8, as_ids=True)[0]
    assert isinstance(request.prompt, list) and len(request.prompt) == 100
    assert maker.count(maker.text(request.prompt)) == 100


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


def test_seeded_and_reproducible():
    a, b = load_prompt_maker(seed=9), load_prompt_maker(seed=9)
    assert a.random_ids(30) == b.random_ids(30)
