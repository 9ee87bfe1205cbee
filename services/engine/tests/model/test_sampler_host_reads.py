"""The sampler reads the device once per step: one `tolist` for tokens, logprobs and
top logprobs together (each read of a CUDA tensor waits for the stream)."""

from __future__ import annotations

import torch

from conveyor.engine.core.scheduler_output import ScheduledRequest
from conveyor.engine.sampling.sampler import Sampler
from conveyor.engine.sampling_params import SamplingParams


def request(params: SamplingParams, rid: str) -> ScheduledRequest:
    return ScheduledRequest(request_id=rid, token_ids=[0], num_computed_tokens=0,
                            block_table=[0], slot_mapping=[0], needs_sample=True,
                            sampling_params=params, prompt_token_ids=[0], output_token_ids=[])


def test_tokens_and_logprobs_come_back_in_one_read(monkeypatch):
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 1.0]])
    requests = [request(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2), "a"),
                request(SamplingParams(temperature=0.7, seed=3, logprobs=True), "b")]
    [a], [b] = Sampler([3], 4, seed=0).sample(logits, requests)
    assert len(reads) == 1
    raw = logits.log_softmax(dim=-1)
    assert a.token_id == 1 and a.logprob == raw[0, 1].item()
    assert a.top_logprobs == [(1, raw[0, 1].item()), (3, raw[0, 3].item())]
    assert b.logprob == raw[1, b.token_id].item() and b.top_logprobs is None
