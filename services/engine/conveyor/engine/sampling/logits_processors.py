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


def keep_only(logits: torch.Tensor, allowed: TokenMask) -> None:
    """-inf at every token of the mask's rows but their (row, token) pairs
    (allowed_token_ids)."""
    kept = logits[allowed.rows, allowed.tokens]
    logits[allowed.rows.unique()] = float("-inf")
    logits[allowed.rows, allowed.tokens] = kept


def apply_logit_bias(logits: torch.Tensor, bias: TokenMask) -> None:
    logits.index_put_((bias.rows, bias.tokens), bias.values, accumulate=True)


def apply_penalties(logits: torch.Tensor, penalties: PenaltyInputs) -> None:
    """vLLM's semantics: repetition over prompt + output (divide positive logits,
    multiply negative ones); frequency by output count; presence once if seen.

    On the CPU only the (row, token) entries a history names are read and written, by
    their index in the flattened logits: tables as wide as the vocabulary took ~40 ms a
    step at 64 rows of 49,152 there. On CUDA those tables are cheap and the entries' count
    would be a host read (it waits for the stream)."""
    if logits.device.type == "cuda":
        _apply_penalties_by_table(logits, penalties)
        return
    vocab = logits.shape[-1]
    flat = logits.view(-1)
    rows = torch.arange(logits.shape[0], device=logits.device)[:, None]
    history = torch.cat([penalties.prompt_ids, penalties.output_ids], dim=1)
    seen = _flat_entries(rows, history, vocab).unique()
    repetition = penalties.repetition[seen // vocab]
    values = flat[seen]
    flat[seen] = torch.where(values > 0, values / repetition, values * repetition)
    output, counts = _flat_entries(rows, penalties.output_ids, vocab).unique(return_counts=True)
    row = output // vocab
    flat[output] = flat[output] - penalties.frequency[row] * counts - penalties.presence[row]


def _flat_entries(rows: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """The flat indices (row x vocab + id) of ids [R, N], padding (id `vocab`) left out."""
    return (rows * vocab + ids)[ids < vocab]


def _apply_penalties_by_table(logits: torch.Tensor, penalties: PenaltyInputs) -> None:
    """`apply_penalties` through V + 1 wide tables (the padding id's column dropped)."""
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


TOP_P_CANDIDATES = (256, 4096)
"""A row's top_p cutoff is looked for among its 256 likeliest tokens, then, where its top_p
mass lies further out, among its 4,096 likeliest; only a row whose mass lies further still
sorts its whole vocabulary (3.4 ms a row of 49,152; topk of 4,096: ~0.4 ms). In story text
at temperature 1, 7% of rows needed more than 256 at top_p 0.9 and 21% at 0.95, none more
than 2,700."""


def apply_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Keep each row's top_k best tokens, then the fewest best tokens whose probability
    (over what top_k kept) reaches top_p; the best token always stays, and a token exactly
    as likely as the last one kept stays too. Neither sorts the vocabulary as a rule: top_k
    takes its k-th best value from `topk`, top_p on the CPU its cutoff from the likeliest
    TOP_P_CANDIDATES (a full sort of 64 rows of 49,152 took 103 ms there)."""
    top_k, top_p = batch.top_k, batch.column("top_p")
    if top_k is not None:
        logits.masked_fill_(logits < _kth_best(logits, top_k, batch.max_top_k), float("-inf"))
    if top_p is not None:
        probs = logits.softmax(dim=-1)
        logits.masked_fill_(probs < _top_p_cutoff(probs, top_p), float("-inf"))


def _kth_best(logits: torch.Tensor, top_k: torch.Tensor, widest: int) -> torch.Tensor:
    """[R, 1]: each row's top_k-th best value; -inf for a row whose top_k is the vocabulary
    (widest: the largest top_k below it)."""
    best = logits.topk(widest, dim=-1).values  # descending
    kth = best.gather(1, (top_k.clamp(max=widest) - 1)[:, None])
    return torch.where(top_k[:, None] < logits.shape[-1], kth, float("-inf"))


def _top_p_cutoff(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, 1]: the least probability a row keeps; 0 (all) for a row whose top_p is 1."""
    if probs.device.type == "cuda":  # no host read (it waits for the stream): sort every row
        ordered = probs.sort(dim=-1, descending=True).values
        return torch.where(top_p[:, None] < 1, _where_mass_reaches(ordered, top_p), 0.0)
    vocab = probs.shape[-1]
    best = probs.topk(min(TOP_P_CANDIDATES[0], vocab), dim=-1).values
    cutoff = _where_mass_reaches(best, top_p)
    rows = ((best.sum(dim=-1) < top_p) & (top_p < 1)).nonzero()[:, 0]
    for num in (*TOP_P_CANDIDATES[1:], vocab):  # the rows whose mass lies further out
        if not len(rows):
            break
        part = probs[rows]
        best = part.topk(num, dim=-1).values if num < vocab else \
            part.sort(dim=-1, descending=True).values
        cutoff[rows] = _where_mass_reaches(best, top_p[rows])
        rows = rows[best.sum(dim=-1) < top_p[rows]]
    return torch.where(top_p[:, None] < 1, cutoff, 0.0)


def _where_mass_reaches(descending: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, 1]: the probability of the first token whose running mass reaches top_p (the
    last token's if it never does)."""
    mass = descending.cumsum(dim=-1)
    first = torch.searchsorted(mass, top_p[:, None]).clamp_(max=descending.shape[-1] - 1)
    return descending.gather(1, first)


FILTERS = (apply_min_p, apply_top_k_top_p)
"""What narrows the temperature-scaled distribution, in this order (vLLM's)."""
