"""top_k and top_p against a reference that sorts the whole vocabulary."""

from __future__ import annotations

import torch

from conveyor.engine.core.scheduler_output import ScheduledRequest
from conveyor.engine.sampling.logits_processors import TOP_P_CANDIDATES, apply_top_k_top_p
from conveyor.engine.sampling.sampling_batch import SamplingBatch
from conveyor.engine.sampling_params import SamplingParams

VOCAB = 16384


def batch_of(*params: SamplingParams) -> SamplingBatch:
    requests = [ScheduledRequest(request_id=str(i), token_ids=[0], num_computed_tokens=0,
                                 block_table=[0], slot_mapping=[0], needs_sample=True,
                                 sampling_params=p, prompt_token_ids=[0], output_token_ids=[])
                for i, p in enumerate(params)]
    return SamplingBatch.from_requests(requests, [0], VOCAB, torch.device("cpu"))


def kept_by_sorting(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The k best, then the fewest best whose renormalised mass reaches p, and every token
    tied with the last one kept."""
    order = row.argsort(descending=True)
    k = top_k or VOCAB
    kept = order[:k]
    probs = row[kept].softmax(dim=-1)
    last = int(torch.searchsorted(probs.cumsum(dim=-1), torch.tensor([top_p])).clamp(max=k - 1))
    least = row[kept[last]]
    return {int(i) for i in kept if row[i] >= least} | {
        int(i) for i in order[:k] if row[i] == least}


def test_matches_a_full_sort_near_and_far_from_the_candidates():
    generator = torch.Generator().manual_seed(0)
    # peaked rows (the top_p mass within the first candidates), rows whose mass lies in the
    # second tier of candidates, and flat ones (beyond every tier: a full sort)
    logits = torch.cat([torch.randn(4, VOCAB, generator=generator) * scale
                        for scale in (4.0, 2.5, 0.1)])
    knobs = [(0, 0.9), (50, 0.9), (5, 1.0), (0, 0.5)] * 3
    out = logits.clone()
    apply_top_k_top_p(out, batch_of(*(SamplingParams(temperature=1.0, top_k=k, top_p=p)
                                      for k, p in knobs)))
    for row, (k, p) in enumerate(knobs):
        assert {int(i) for i in out[row].isfinite().nonzero()} == \
            kept_by_sorting(logits[row], k, p), (row, k, p)
    first, second = TOP_P_CANDIDATES
    assert first < out[4].isfinite().sum().item() <= second, "a nucleus in the second tier"
    assert out[8].isfinite().sum().item() > second, "a flat row's nucleus beyond every tier"


def test_neutral_rows_beside_filtered_ones_keep_everything():
    logits = torch.randn(3, VOCAB)
    out = logits.clone()
    apply_top_k_top_p(out, batch_of(SamplingParams(temperature=1.0, top_k=3),
                                    SamplingParams(temperature=1.0, top_p=0.3),
                                    SamplingParams(temperature=1.0)))
    assert out[0].isfinite().sum() == 3 and out[1].isfinite().sum() < VOCAB
    assert torch.equal(out[2], logits[2])


def test_a_token_tied_with_the_last_kept_stays():
    logits = torch.full((2, VOCAB), -10.0)
    logits[:, :3] = torch.tensor([2.0, 1.0, 1.0])
    out = logits.clone()
    apply_top_k_top_p(out, batch_of(SamplingParams(temperature=1.0, top_k=2),
                                    SamplingParams(temperature=1.0, top_p=0.6)))
    assert out[0].isfinite().nonzero().flatten().tolist() == [0, 1, 2]
    assert out[1].isfinite().nonzero().flatten().tolist() == [0, 1, 2]
