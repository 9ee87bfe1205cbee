"""The sampler with structured-output masks on hand-made logits: the mask comes first (before
logprobs, logit_bias, penalties, temperature and the filters), constrained and free rows
share one batch, and a complete constraint leaves EOS alone to be drawn."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.engine import StructuredOutputsParams
from conveyor.engine.core.scheduler_output import ScheduledRequest
from conveyor.engine.sampling.sampler import Sampler
from conveyor.engine.sampling_params import SamplingParams

TOKENS = [b"a", b"b", b"c", b"{", b"}", b"0", b"1", b""]
A, B, C, EOS = 0, 1, 2, 7
LOGITS = torch.tensor([[1.0, 0.5, 4.0, 3.0, 2.0, -1.0, -2.0, 0.0]])  # c is the model's pick


@pytest.fixture
def matcher(make_tiny_compiler):
    """`matcher(regex)`: a fresh matcher at the start of that regex."""
    compiler = make_tiny_compiler(TOKENS, EOS)
    return lambda regex: compiler.compile(
        StructuredOutputsParams(regex=regex)).result().new_matcher()


def row(params: SamplingParams, grammar=None, output: list[int] | None = None,
        rid: str = "r") -> ScheduledRequest:
    return ScheduledRequest(request_id=rid, token_ids=[0], num_computed_tokens=0,
                            block_table=[0], slot_mapping=[0], needs_sample=True,
                            sampling_params=params, prompt_token_ids=[A],
                            output_token_ids=list(output or []), grammar=grammar)


def sample(rows: list[ScheduledRequest], logits: torch.Tensor | None = None, seed: int = 0):
    logits = LOGITS.repeat(len(rows), 1) if logits is None else logits
    return [token for [token] in Sampler([EOS], len(TOKENS), seed=seed).sample(logits, rows)]


def test_greedy_takes_the_best_allowed_token_not_the_best_token(matcher):
    [token] = sample([row(SamplingParams(temperature=0.0), matcher("[ab]c"))])
    assert token.token_id == A


def test_logprobs_are_the_masked_distribution_renormalised(matcher):
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    [token] = sample([row(params, matcher("[ab]c"))])
    norm = math.log(math.exp(1.0) + math.exp(0.5))
    assert token.logprob == pytest.approx(1.0 - norm, abs=1e-5)
    (first, p_a), (second, p_b), (_, p_masked) = token.top_logprobs
    assert (first, second) == (A, B)
    assert p_b == pytest.approx(0.5 - norm, abs=1e-5) and p_masked == -math.inf


def test_logit_bias_and_penalties_cannot_bring_back_a_masked_token(matcher):
    params = SamplingParams(temperature=0.0, logit_bias={C: 100.0, B: 5.0},
                            frequency_penalty=2.0, repetition_penalty=2.0)
    [token] = sample([row(params, matcher("[ab]c"), output=[A])])
    assert token.token_id == B  # c is masked whatever its bias; b beats the penalised a


def test_sampled_rows_draw_only_allowed_tokens_and_free_rows_are_untouched(matcher):
    free_greedy = row(SamplingParams(temperature=0.0), rid="free-greedy")
    free_hot = row(SamplingParams(temperature=1.0, seed=3), rid="free-hot")
    rows = [free_greedy, free_hot]
    for i in range(40):
        rows.append(row(SamplingParams(temperature=5.0, seed=i), matcher("[ab01]c"),
                        rid=f"hot-{i}"))
        rows.append(row(SamplingParams(temperature=0.0), matcher("[01]"), rid=f"greedy-{i}"))
    tokens = [t.token_id for t in sample(rows)]
    alone = [t.token_id for t in sample([free_greedy, free_hot])]
    assert tokens[:2] == alone  # masks of other rows change nothing in theirs
    hot, greedy = set(tokens[2::2]), set(tokens[3::2])
    assert hot <= {A, B, 5, 6} and len(hot) > 1  # drawn, and only among the allowed
    assert greedy == {5}


def test_a_complete_constraint_draws_eos_even_before_min_tokens(matcher):
    grammar = matcher("a")
    grammar.accept(A)
    params = SamplingParams(temperature=1.0, min_tokens=5, max_tokens=8, ignore_eos=True)
    [token] = sample([row(params, grammar, output=[A])])
    assert grammar.is_complete and token.token_id == EOS


def test_min_tokens_still_holds_eos_back_where_the_constraint_may_go_on(matcher):
    grammar = matcher("a+")
    grammar.accept(A)  # "a" is a whole match, EOS allowed, but more a's may follow
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0]])  # the model wants EOS
    free = SamplingParams(temperature=0.0)
    held = SamplingParams(temperature=0.0, min_tokens=3)
    assert sample([row(free, grammar, output=[A])], logits)[0].token_id == EOS
    assert sample([row(held, grammar, output=[A])], logits)[0].token_id == A


def test_the_device_unpacking_of_masks_matches_the_hosts():
    import numpy as np

    from conveyor.engine.sampling.sampling_batch import _disallowed, unpack_disallowed

    bitmask = np.random.default_rng(0).integers(-2**31, 2**31, (3, 4), dtype=np.int32)
    on_host = _disallowed(bitmask, 100, torch.device("cpu"))
    assert torch.equal(unpack_disallowed(torch.from_numpy(bitmask), 100), on_host)
    assert on_host[0, 5].item() == (not bitmask[0, 0] >> 5 & 1)
