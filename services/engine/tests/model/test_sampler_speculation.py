"""Verifying drafts in the sampler (speculative decoding), on hand-made logits: greedy
keeps the argmax chain; sampling keeps the target distribution (chi-square)."""

from __future__ import annotations

import torch

from conveyor.engine.core.scheduler_output import ScheduledRequest
from conveyor.engine.sampling.sampler import Sampler
from conveyor.engine.sampling_params import SamplingParams

VOCAB = 5
EOS = 4
CHI2_DF3_P001 = 16.27
"""The chi-square value a 4-category sample exceeds with probability 0.001 when it is
drawn from the expected distribution (3 degrees of freedom)."""


def request(params: SamplingParams, drafts: list[int], output: list[int] | None = None,
            rid: str = "r") -> ScheduledRequest:
    return ScheduledRequest(request_id=rid, token_ids=[0, *drafts], num_computed_tokens=0,
                            block_table=[0], slot_mapping=list(range(1 + len(drafts))),
                            needs_sample=True, sampling_params=params, prompt_token_ids=[0],
                            output_token_ids=list(output or []), draft_token_ids=drafts)


def rows(*preferred: int, strength: float = 5.0) -> torch.Tensor:
    """One logits row per argument, each preferring that token."""
    logits = torch.zeros(len(preferred), VOCAB)
    for row, token in enumerate(preferred):
        logits[row, token] = strength
    return logits


def ids(tokens) -> list[int]:
    return [t.token_id for t in tokens]


def test_greedy_accepts_drafts_while_they_are_the_argmax_then_takes_the_argmax():
    greedy = SamplingParams(temperature=0.0)
    [rejected, all_kept, plain] = Sampler([EOS], VOCAB).sample(
        torch.cat([rows(1, 2, 0, 3), rows(1, 2, 3), rows(2)]),
        [request(greedy, [1, 2, 3], rid="a"), request(greedy, [1, 2], rid="b"),
         request(greedy, [], rid="c")])
    assert ids(rejected) == [1, 2, 0]  # the third draft (3) lost to the argmax (0)
    assert ids(all_kept) == [1, 2, 3]  # both drafts and the token after them
    assert ids(plain) == [2]


def test_each_row_sees_the_drafts_before_it_as_output():
    """A presence penalty on row 1 applies to draft 0, as it would once that was output."""
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    logits = torch.tensor([[0.0, 3.0, 2.0, 0.0, 0.0]] * 2)
    [tokens] = Sampler([EOS], VOCAB).sample(logits, [request(params, [1])])
    assert ids(tokens) == [1, 2]


def test_logprobs_are_each_rows_own():
    params = SamplingParams(temperature=0.0, logprobs=True)
    logits = torch.cat([rows(1, strength=2.0), rows(2, strength=4.0)])
    [tokens] = Sampler([EOS], VOCAB).sample(logits, [request(params, [1])])
    raw = logits.log_softmax(dim=-1)
    assert [t.logprob for t in tokens] == [raw[0, 1].item(), raw[1, 2].item()]


def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * observed.sum()
    return float(((observed - expected) ** 2 / expected).sum())


def test_sampled_tokens_keep_the_target_distribution():
    """Draft 1 then 2 against rows whose distributions disagree with them in part: the
    first token, and the second given the first was the accepted draft, are distributed
    as the rows say, whatever the drafts were."""
    target = torch.tensor([[0.1, 0.4, 0.2, 0.3, 1e-9], [0.25, 0.25, 0.1, 0.4, 1e-9],
                           [0.4, 0.3, 0.2, 0.1, 1e-9]]).log()
    draws = 6000
    params = SamplingParams(temperature=1.0)
    sampled = Sampler([EOS], VOCAB, seed=1).sample(
        target.repeat(draws, 1), [request(params, [1, 2], rid=str(i)) for i in range(draws)])
    first = torch.bincount(torch.tensor([t[0].token_id for t in sampled]), minlength=VOCAB)
    after_draft = torch.bincount(torch.tensor([t[1].token_id for t in sampled
                                               if t[0].token_id == 1]), minlength=VOCAB)
    probs = target.exp()
    assert first[EOS] == 0 and after_draft[EOS] == 0
    assert chi_square(first[:4].double(), probs[0, :4].double()) < CHI2_DF3_P001
    assert chi_square(after_draft[:4].double(), probs[1, :4].double()) < CHI2_DF3_P001
    assert 0 < sum(len(t) == 3 for t in sampled) < draws  # both drafts kept, some of the time


def test_a_seeded_request_verifies_the_same_way_in_any_batch():
    seeded = SamplingParams(temperature=1.0, seed=11)
    logits = torch.zeros(3, VOCAB)
    alone = Sampler([EOS], VOCAB, seed=1).sample(logits, [request(seeded, [1, 2])])
    other = SamplingParams(temperature=1.0)
    batched = Sampler([EOS], VOCAB, seed=2).sample(
        torch.zeros(5, VOCAB), [request(other, [3]), request(seeded, [1, 2], rid="s")])
    assert ids(alone[0]) == ids(batched[1])


def test_a_seeded_request_draws_the_same_tokens_with_or_without_drafts():
    """Row j draws what the request's seed draws at that position: drafts change how many
    steps the tokens take, not which tokens."""
    logits = torch.tensor([[0.5, 1.0, 0.2, 0.8, -9.0], [1.0, 0.1, 0.9, 0.3, -9.0]])
    for seed in range(40):
        params = SamplingParams(temperature=1.0, seed=seed)
        [[first]] = Sampler([EOS], VOCAB).sample(logits[:1], [request(params, [])])
        expected = [first.token_id]
        if first.token_id == 1:  # the draft below: the second token is drawn after it
            [[second]] = Sampler([EOS], VOCAB).sample(logits[1:], [request(params, [], [1])])
            expected.append(second.token_id)
        [tokens] = Sampler([EOS], VOCAB).sample(logits, [request(params, [1])])
        assert ids(tokens) == expected, seed
