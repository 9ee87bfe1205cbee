"""In-place transformations of a [N, V] fp32 logits batch, one row per request.

Each function is vectorized over rows; rows whose parameter is neutral
(top_k = V, top_p = 1, min_p = 0, penalty 0 or 1) come out unchanged.
`FILTERS` run in order on the temperature-scaled logits of the sampled rows; each
takes its knobs' per-row values from the batch (`batch.column(name)`, None when no
row uses the knob).
"""

from __future__ import annotations

import torch

from conveyor.engine.sampling.sampling_batch import (
    GrammarMask,
    PenaltyInputs,
    SamplingBatch,
    TokenMask,
)


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """-inf at every token a constrained row's grammar does not allow, all rows in one op;
    unconstrained rows are left alone."""
    if mask.covers_batch:
        logits.masked_fill_(mask.disallowed, float("-inf"))
        return
    rows = logits.index_select(0, mask.rows).masked_fill_(mask.disallowed, float("-inf"))
    logits.index_copy_(0, mask.rows, rows)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """-inf at the masked (row, token) pairs (min_tokens: EOS and stop ids)."""
    logits[mask.rows, mask.tokens] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, bias: TokenMask) -> None:
    logits.index_put_((bias.rows, bias.tokens), bias.values, accumulate=True)


def apply_penalties(logits: torch.Tensor, penalties: PenaltyInputs) -> None:
    """vLLM's semantics: repetition over prompt + output (divide positive logits,
    multiply negative ones); frequency by output count; presence once if seen."""
    num_rows, vocab = logits.shape
    counts = torch.zeros(num_rows, vocab + 1, device=logits.device)
    counts.scatter_add_(1, penalties.output_ids, torch.ones_like(penalties.output_ids,
                                                                 dtype=counts.dtype))
    counts = counts[:, :vocab]
    in_prompt = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
    in_prompt.scatter_(1, penalties.prompt_ids, True)
    seen = in_prompt[:, :vocab] | (counts > 0)
    repetition = torch.where(seen, penalties.repetition[:, None], 1.0)
    logits.copy_(torch.where(logits > 0, logits / repetition, logits * repetition))
    logits -= penalties.frequency[:, None] * counts
    logits -= penalties.presence[:, None] * (counts > 0)


def apply_min_p(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Drop tokens whose probability is below min_p x the row's top probability."""
    min_p = batch.column("min_p")
    if min_p is None:
        return
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Keep each row's top_k best tokens, then the smallest prefix of those whose
    probability mass reaches top_p (the best token always stays)."""
    top_k, top_p = batch.top_k, batch.column("top_p")
    if top_k is None and top_p is None:
        return
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits.masked_fill_(ranks[None, :] >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits.masked_fill_(mass_before >= top_p[:, None], float("-inf"))
    logits.scatter_(-1, order, sorted_logits)


FILTERS = (apply_min_p, apply_top_k_top_p)
"""What narrows the temperature-scaled distribution, in this order (vLLM's)."""
