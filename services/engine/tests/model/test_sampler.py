"""The sampler on hand-made logits (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.engine.core.scheduler_output import ScheduledRequest
from conveyor.engine.sampling.sampler import Sampler
from conveyor.engine.sampling_params import SamplingParams

VOCAB = 8
EOS = 7


def request(params: SamplingParams, output: list[int] | None = None,
            prompt: list[int] | None = None, rid: str = "r") -> ScheduledRequest:
    return ScheduledRequest(request_id=rid, token_ids=[0], num_computed_tokens=0,
                            block_table=[0], slot_mapping=[0], needs_sample=True,
                            sampling_params=params, prompt_token_ids=prompt or [0],
                            output_token_ids=output or [])


def sampler(seed: int = 0) -> Sampler:
    return Sampler([EOS], VOCAB, seed=seed)


def counts(params: SamplingParams, logits: torch.Tensor, draws: int = 400) -> torch.Tensor:
    """How often each token is drawn for the same row repeated `draws` times."""
    reqs = [request(params, rid=str(i)) for i in range(draws)]
    tokens = [t.token_id for [t] in sampler().sample(logits.repeat(draws, 1), reqs)]
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB)


LOGITS = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]])


def test_greedy_takes_argmax_per_row():
    logits = torch.tensor([[0.0, 5.0, 1, 0, 0, 0, 0, 0], [9.0, 0, 0, 0, 0, 0, 0, 1]])
    reqs = [request(SamplingParams(temperature=0.0)), request(SamplingParams(top_k=1))]
    assert [t.token_id for [t] in sampler().sample(logits, reqs)] == [1, 0]


def test_temperature_sampling_follows_softmax():
    seen = counts(SamplingParams(temperature=1.0), LOGITS, draws=2000)
    expected = LOGITS.softmax(-1)[0] * 2000
    assert seen[0] == pytest.approx(expected[0].item(), rel=0.1)
    assert seen[1] == pytest.approx(expected[1].item(), rel=0.15)


def test_top_k_keeps_only_k_best():
    seen = counts(SamplingParams(temperature=5.0, top_k=3), LOGITS)
    assert seen[3:].sum() == 0 and (seen[:3] > 0).all()


def test_top_p_keeps_smallest_prefix_reaching_p():
    # probs of LOGITS: 0.64, 0.24, 0.09, ... -> top_p 0.8 keeps tokens 0 and 1.
    seen = counts(SamplingParams(temperature=1.0, top_p=0.8), LOGITS)
    assert seen[2:].sum() == 0 and (seen[:2] > 0).all()


def test_top_p_always_keeps_the_best_token():
    seen = counts(SamplingParams(temperature=1.0, top_p=0.01), LOGITS, draws=50)
    assert seen[0] == 50


def test_min_p_drops_tokens_below_fraction_of_top():
    # p1/p0 = e^-1 = 0.37, p2/p0 = e^-2 = 0.14: min_p 0.2 keeps tokens 0 and 1.
    seen = counts(SamplingParams(temperature=1.0, min_p=0.2), LOGITS)
    assert seen[2:].sum() == 0 and (seen[:2] > 0).all()


def test_seed_reproducible_across_batches_and_samplers():
    params = SamplingParams(temperature=1.0, seed=1234)
    flat = torch.zeros(1, VOCAB)

    def draw(output: list[int], batch_mates: int, sampler_seed: int) -> int:
        reqs = [request(params, output=output)] + [
            request(SamplingParams(temperature=1.0), rid=f"m{i}") for i in range(batch_mates)]
        logits = flat.repeat(batch_mates + 1, 1)
        return sampler(sampler_seed).sample(logits, reqs)[0][0].token_id

    first = [draw(list(range(pos)), 0, 0) for pos in range(12)]
    again = [draw(list(range(pos)), 3, 99) for pos in range(12)]
    assert first == again
    assert len(set(first)) > 1, "draws at different positions should differ"


def test_different_seeds_differ():
    flat = torch.zeros(1, VOCAB)
    draws = {tuple(sampler().sample(flat, [request(SamplingParams(seed=s), output=[0] * p)])[0][0]
                   .token_id for p in range(6)) for s in range(5)}
    assert len(draws) > 1


def test_unseeded_sampler_seed_reproducible():
    reqs = [request(SamplingParams(temperature=1.0), rid=str(i)) for i in range(20)]
    logits = torch.zeros(20, VOCAB)
    first = [t.token_id for [t] in sampler(7).sample(logits, reqs)]
    assert first == [t.token_id for [t] in sampler(7).sample(logits, reqs)]


def test_repetition_penalty_over_prompt_and_output():
    logits = torch.tensor([[2.0, 2.0, -2.0, -2.0, 1.0, 0, 0, 0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    processed = processed_logits(logits, request(params, output=[0], prompt=[2]))
    assert processed[0].tolist()[:5] == [1.0, 2.0, -4.0, -2.0, 1.0]


def test_frequency_and_presence_penalties_over_output_only():
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    processed = processed_logits(logits, request(params, output=[3, 3, 4], prompt=[5]))
    assert processed[0].tolist()[3:6] == [-2.0, -1.5, 0.0]


def test_penalties_leave_other_rows_alone():
    logits = torch.ones(2, VOCAB)
    reqs = [request(SamplingParams(presence_penalty=2.0), output=[1]),
            request(SamplingParams(), output=[1])]
    s = sampler()
    from conveyor.engine.sampling.sampling_batch import SamplingBatch

    batch = SamplingBatch.from_requests(reqs, [EOS], VOCAB, torch.device("cpu"))
    s._apply_processors(logits, batch)
    assert logits[0, 1] == -1.0 and (logits[1] == 1.0).all()


def test_logit_bias_added_and_steers_greedy():
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(temperature=0.0, logit_bias={5: 3.0, 2: -100.0})
    processed = processed_logits(logits, request(params))
    assert processed[0, 5] == 3.0 and processed[0, 2] == -100.0
    assert sampler().sample(logits, [request(params)])[0][0].token_id == 5


def test_allowed_token_ids_keep_a_rows_draws_among_them_and_leave_others_alone():
    allowed = SamplingParams(temperature=0.0, allowed_token_ids=[5, 3, 5], logprobs=True)
    assert allowed.allowed_token_ids == [3, 5]  # sorted, each id once
    [[greedy], [other]] = sampler().sample(LOGITS.repeat(2, 1),
                                           [request(allowed), request(SamplingParams(
                                               temperature=0.0), rid="o")])
    assert (greedy.token_id, other.token_id) == (3, 0)  # 3 is the likelier of 3 and 5
    assert greedy.logprob == pytest.approx(LOGITS.log_softmax(-1)[0, 3].item(), abs=1e-6)
    seen = counts(SamplingParams(temperature=2.0, allowed_token_ids=[1, 6]), LOGITS)
    assert seen[1] > 0 and seen[6] > 0 and seen.sum() == seen[1] + seen[6]


def test_bad_words_ban_the_token_that_would_complete_one():
    params = SamplingParams(temperature=0.0, bad_words=[[0], [5, 1]])
    [[fresh], [after_five], [after_six]] = sampler().sample(LOGITS.repeat(3, 1), [
        request(params), request(params, output=[5], rid="5"), request(params, output=[6],
                                                                        rid="6")])
    assert (fresh.token_id, after_five.token_id, after_six.token_id) == (1, 2, 1)
    seen = counts(SamplingParams(temperature=1.0, bad_words=[[0], [1]]), LOGITS)
    assert seen[0] == seen[1] == 0 and seen[2] > 0


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 3] = 9.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    assert sampler().sample(logits, [request(params, output=[1])])[0][0].token_id not in (EOS, 3)
    assert sampler().sample(logits, [request(params, output=[1, 1])])[0][0].token_id == EOS


def test_min_tokens_with_ignore_eos_only_masks_stop_ids():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    params = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sampler().sample(logits, [request(params)])[0][0].token_id == EOS


def test_logprobs_are_raw_model_logprobs():
    logits = LOGITS.clone()
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3,
                            logit_bias={4: 50.0})
    token = sampler().sample(logits, [request(params)])[0][0]
    raw = LOGITS.log_softmax(-1)[0]
    assert token.token_id == 4
    assert token.logprob == pytest.approx(raw[4].item(), abs=1e-6)
    assert [t for t, _ in token.top_logprobs] == [0, 1, 2]
    assert token.top_logprobs[0][1] == pytest.approx(raw[0].item(), abs=1e-6)
    assert math.isclose(sum(math.exp(v) for v in raw.tolist()), 1.0, rel_tol=1e-5)


def test_logprobs_only_for_rows_that_ask():
    reqs = [request(SamplingParams(temperature=0.0, top_logprobs=2), rid="a"),
            request(SamplingParams(temperature=0.0), rid="b"),
            request(SamplingParams(temperature=0.0, logprobs=True), rid="c")]
    [a], [b], [c] = sampler().sample(LOGITS.repeat(3, 1), reqs)
    assert len(a.top_logprobs) == 2 and a.logprob is not None
    assert b.logprob is None and b.top_logprobs is None
    assert c.logprob is not None and c.top_logprobs is None


def test_mixed_batch_greedy_and_random_rows():
    logits = LOGITS.repeat(4, 1)
    reqs = [request(SamplingParams(temperature=0.0), rid="g"),
            request(SamplingParams(temperature=1.0, top_k=2, seed=5), rid="s"),
            request(SamplingParams(temperature=1.0, top_p=0.5), rid="p"),
            request(SamplingParams(temperature=1e-9), rid="tiny")]
    tokens = [t.token_id for [t] in sampler().sample(logits, reqs)]
    assert tokens[0] == 0 and tokens[1] in (0, 1) and tokens[2] == 0 and tokens[3] == 0


def processed_logits(logits: torch.Tensor, req: ScheduledRequest) -> torch.Tensor:
    from conveyor.engine.sampling.sampling_batch import SamplingBatch

    out = logits.clone()
    batch = SamplingBatch.from_requests([req], [EOS], VOCAB, torch.device("cpu"))
    sampler()._apply_processors(out, batch)
    return out
