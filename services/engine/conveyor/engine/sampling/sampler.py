"""The sampler: one call per step over the rows of every request that needs a token."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from conveyor.engine.core.scheduler_output import SampledToken, ScheduledRequest
from conveyor.engine.sampling import inverse_transform, spec_rows
from conveyor.engine.sampling import logits_processors as lp
from conveyor.engine.sampling.row_argmax import row_argmax
from conveyor.engine.sampling.sampling_batch import SamplingBatch


class Sampler:
    """Greedy, temperature, min_p, top_k, top_p; penalties, logit_bias, min_tokens,
    allowed_token_ids, bad_words; structured-output masks; verification of speculative drafts.

    Order (vLLM's): a constrained row's grammar mask comes first; then logprobs are
    taken (what logprobs report: the model's distribution, renormalised over the tokens
    the grammar allows on a constrained row, so a masked alternative has -inf); then
    allowed_token_ids, bad_words, min_tokens masking, logit_bias and penalties; greedy
    rows take the argmax here; the rest are divided by temperature, filtered by min_p,
    top_k, top_p and drawn by inverse transform sampling (inverse_transform.py: one uniform
    number a row, where an exponential race needs one a vocabulary entry: at 64 rows
    of 49,152 its noise alone took 57 ms). Seeded rows take their number from a
    generator seeded by (seed, output position), so a seeded request is reproducible
    in any batch.

    A request with drafts has one row per draft and one after them (spec_rows.py):
    row j is sampled exactly as it would be with the drafts before j as output (its
    seed's draw at that position included), and the drafts are kept while each is what
    its row drew. For a proposer certain of its draft d (n-gram, a greedy draft model)
    that is rejection sampling (Leviathan et al. 2023, q a point mass): d is kept with
    probability p(d), and a rejected row's draw is distributed as p without d,
    renormalised. So each token follows the target distribution, greedy output is the
    argmax chain, and a seeded request draws the same tokens with or without drafts.
    """

    def __init__(self, eos_token_ids: Sequence[int], vocab_size: int,
                 device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._generator = torch.Generator(self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor,
               requests: Sequence[ScheduledRequest]) -> list[list[SampledToken]]:
        """logits [R, V]: `num_sample_rows` rows for each of `requests`, in order; returns
        each request's new tokens: one, or the drafts accepted and the token after them."""
        rows = spec_rows.expand(requests)
        batch = SamplingBatch.from_requests(rows, self.eos_token_ids, self.vocab_size,
                                            logits.device)
        if batch.grammar_mask is not None:
            logits = logits.to(torch.float32, copy=True)
            lp.apply_grammar_mask(logits, batch.grammar_mask)
        raw_logprobs = logits.float().log_softmax(dim=-1) if batch.needs_logprobs else None
        if batch.all_greedy and not batch.has_processors:
            tokens = row_argmax(logits)  # nothing modifies the logits: no copy
        else:
            processed = logits.to(torch.float32, copy=True)
            self._apply_processors(processed, batch)
            tokens = self._choose(processed, batch)
        per_row = self._to_sampled_tokens(tokens, raw_logprobs, rows, batch)
        return spec_rows.accepted(per_row, requests)

    def _apply_processors(self, logits: torch.Tensor, batch: SamplingBatch) -> None:
        if batch.allowed_tokens is not None:
            lp.keep_only(logits, batch.allowed_tokens)
        if batch.bad_words_mask is not None:
            lp.apply_token_mask(logits, batch.bad_words_mask)
        if batch.min_tokens_mask is not None:
            lp.apply_token_mask(logits, batch.min_tokens_mask)
        if batch.logit_bias is not None:
            lp.apply_logit_bias(logits, batch.logit_bias)
        if batch.penalties is not None:
            lp.apply_penalties(logits, batch.penalties)

    def _choose(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy_tokens = row_argmax(logits)
        if batch.all_greedy:
            return greedy_tokens
        logits.div_(batch.temperature[:, None])
        for apply_filter in lp.FILTERS:
            apply_filter(logits, batch)
        weights = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()  # softmax x a factor
        random_tokens = inverse_transform.draw(weights, self._uniform_reach(len(logits), batch))
        return torch.where(batch.greedy, greedy_tokens, random_tokens)

    def _uniform_reach(self, rows: int, batch: SamplingBatch) -> torch.Tensor:
        """[rows, 1] float64 uniform in (0, 1]; a seeded row's from its own generator."""
        uniform = torch.rand(rows, 1, generator=self._generator, device=self.device,
                             dtype=torch.float64)
        for row, seed in batch.seeds:
            generator = torch.Generator(self.device).manual_seed(seed)
            uniform[row] = torch.rand(1, generator=generator, device=self.device,
                                      dtype=torch.float64)
        return 1 - uniform

    def _to_sampled_tokens(self, tokens: torch.Tensor, raw_logprobs: torch.Tensor | None,
                           requests: Sequence[ScheduledRequest],
                           batch: SamplingBatch) -> list[SampledToken]:
        """One device-to-host read per step: the tokens, and with logprobs the chosen
        logprob and the top-k ids and values, as float64 columns (exact for token ids
        and fp32 values)."""
        if raw_logprobs is None:
            return [SampledToken(token) for token in tokens.tolist()]
        num_top = batch.max_top_logprobs
        columns = [tokens[:, None], raw_logprobs.gather(1, tokens[:, None])]
        if num_top:
            top_values, top_ids = raw_logprobs.topk(num_top, dim=-1)
            columns += [top_ids, top_values]
        rows = torch.cat([c.double() for c in columns], dim=1).tolist()
        return [self._with_logprobs(row, num_top, r.sampling_params.logprobs,
                                    r.sampling_params.top_logprobs)
                for row, r in zip(rows, requests, strict=True)]

    @staticmethod
    def _with_logprobs(row: list[float], max_top: int, wants_logprob: bool,
                       num_top: int) -> SampledToken:
        """row: token, its logprob, max_top ids, max_top values."""
        token = int(row[0])
        if not (wants_logprob or num_top):
            return SampledToken(token)
        ids, values = row[2:2 + max_top], row[2 + max_top:]
        top = ([(int(i), v) for i, v in zip(ids[:num_top], values[:num_top], strict=True)]
               if num_top else None)
        return SampledToken(token, row[1], top)
