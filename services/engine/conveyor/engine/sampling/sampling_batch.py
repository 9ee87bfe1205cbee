"""One step's sampling parameters as tensors, one row per request that samples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from conveyor.common.sampling_fields import DEFAULTS
from conveyor.engine.core.scheduler_output import ScheduledRequest
from conveyor.engine.sampling_params import SamplingParams

MIN_TEMPERATURE = 1e-5
"""Below this a temperature is treated as greedy (dividing by it overflows fp32)."""


@dataclass(slots=True)
class TokenMask:
    """(row, token) pairs, with a value for each when it is a bias."""

    rows: torch.Tensor
    tokens: torch.Tensor
    values: torch.Tensor | None = None


@dataclass(slots=True)
class GrammarMask:
    """The tokens the constrained rows may not take next: `disallowed[k, t]` for row
    `rows[k]`; `covers_batch` when every row of the batch is constrained (then rows[k] = k)."""

    rows: torch.Tensor
    disallowed: torch.Tensor
    covers_batch: bool


@dataclass(slots=True)
class PenaltyInputs:
    """Token histories of the rows with penalties, padded with `vocab_size` (one past the
    vocabulary, so no padding id names a real token)."""

    prompt_ids: torch.Tensor
    output_ids: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor


@dataclass(slots=True)
class SamplingBatch:
    """Invariant: every tensor has one row per sampled request, in the runner's order.
    Optional parts are None when no row uses them, so their cost is skipped."""

    greedy: torch.Tensor
    all_greedy: bool
    temperature: torch.Tensor
    top_k: torch.Tensor | None
    max_top_k: int
    """The largest top_k below the vocabulary (0 when no row has one), read on the host."""
    penalties: PenaltyInputs | None
    logit_bias: TokenMask | None
    min_tokens_mask: TokenMask | None
    allowed_tokens: TokenMask | None
    """(row, token) for each token a row with allowed_token_ids may take."""
    bad_words_mask: TokenMask | None
    """(row, token) for each token that would complete one of the row's bad words now."""
    grammar_mask: GrammarMask | None
    seeds: list[tuple[int, int]]
    """(row, generator seed) for rows with a per-request seed."""
    max_top_logprobs: int
    needs_logprobs: bool
    params: list[SamplingParams]
    device: torch.device

    def column(self, name: str) -> torch.Tensor | None:
        """Knob `name` of the shared table (conveyor.common.sampling_fields) per row, as
        float32 on the batch's device; None when every row has the knob's default (its
        neutral value), so a filter given None leaves the logits alone."""
        return _optional([getattr(p, name) for p in self.params], DEFAULTS[name], self.device)

    @property
    def has_processors(self) -> bool:
        """Whether any row has min_tokens masking, allowed tokens, bad words, logit_bias or
        penalties."""
        return (self.min_tokens_mask is not None or self.allowed_tokens is not None
                or self.bad_words_mask is not None or self.logit_bias is not None
                or self.penalties is not None)

    @classmethod
    def from_requests(cls, requests: Sequence[ScheduledRequest], eos_token_ids: Sequence[int],
                      vocab_size: int, device: torch.device) -> SamplingBatch:
        params = [r.sampling_params for r in requests]
        greedy = [p.is_greedy or p.temperature < MIN_TEMPERATURE for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        max_top_k = max((k for k in top_k if k < vocab_size), default=0)
        return cls(
            greedy=_on_device(greedy, device),
            all_greedy=all(greedy),
            temperature=_on_device([1.0 if g else p.temperature
                                    for p, g in zip(params, greedy, strict=True)], device),
            top_k=_on_device(top_k, device) if max_top_k else None,
            max_top_k=max_top_k,
            penalties=_penalty_inputs(requests, vocab_size, device),
            logit_bias=_logit_bias(params, device),
            min_tokens_mask=_min_tokens_mask(requests, eos_token_ids, device),
            allowed_tokens=_allowed_tokens(params, device),
            bad_words_mask=_bad_words_mask(requests, device),
            grammar_mask=_grammar_mask(requests, vocab_size, device),
            seeds=[(row, seed_for_position(r.sampling_params.seed, len(r.output_token_ids)))
                   for row, r in enumerate(requests) if r.sampling_params.seed is not None],
            max_top_logprobs=max((p.top_logprobs for p in params), default=0),
            needs_logprobs=any(p.logprobs or p.top_logprobs for p in params),
            params=params,
            device=device,
        )


def _on_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` as a tensor on `device`. On CUDA it goes up from pinned memory without
    blocking: torch.tensor(..., device="cuda") synchronises the stream, which made a
    step wait for the device once per sampling tensor."""
    return _moved(torch.tensor(values, dtype=dtype), device)


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def seed_for_position(seed: int, position: int) -> int:
    """A generator seed per (request seed, output position): a request's draws depend
    only on its seed and how many tokens it has produced, not on its batch-mates."""
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % (1 << 63)


def _optional(values: list[float], neutral: float, device: torch.device) -> torch.Tensor | None:
    if all(v == neutral for v in values):
        return None
    return _on_device(values, device, torch.float32)


def _penalty_inputs(requests: Sequence[ScheduledRequest], vocab_size: int,
                    device: torch.device) -> PenaltyInputs | None:
    params = [r.sampling_params for r in requests]
    if not any(p.has_penalties for p in params):
        return None
    prompts = [r.prompt_token_ids if r.sampling_params.repetition_penalty != 1.0 else []
               for r in requests]
    outputs = [r.output_token_ids if r.sampling_params.has_penalties else [] for r in requests]
    return PenaltyInputs(
        prompt_ids=_padded(prompts, vocab_size, device),
        output_ids=_padded(outputs, vocab_size, device),
        presence=_on_device([p.presence_penalty for p in params], device),
        frequency=_on_device([p.frequency_penalty for p in params], device),
        repetition=_on_device([p.repetition_penalty for p in params], device),
    )


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return _on_device([list(r) + [pad] * (width - len(r)) for r in rows], device)


def _logit_bias(params, device: torch.device) -> TokenMask | None:
    entries = [(row, token, bias) for row, p in enumerate(params)
               for token, bias in p.logit_bias.items()]
    if not entries:
        return None
    rows, tokens, values = zip(*entries, strict=True)
    return TokenMask(_on_device(rows, device), _on_device(tokens, device),
                     _on_device(values, device, torch.float32))


def _allowed_tokens(params, device: torch.device) -> TokenMask | None:
    """The rows' allowed ids from each request's own tensor (made at its first step)."""
    rows = [(row, _allowed_ids(p)) for row, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return None
    counts = torch.tensor([len(ids) for _, ids in rows])
    row_ids = torch.repeat_interleave(torch.tensor([row for row, _ in rows]), counts)
    return TokenMask(_moved(row_ids, device), _moved(torch.cat([ids for _, ids in rows]), device))


def _bad_words_mask(requests: Sequence[ScheduledRequest],
                    device: torch.device) -> TokenMask | None:
    """The last token of each bad word whose other tokens end the row's output so far."""
    pairs = []
    for row, r in enumerate(requests):
        output = r.output_token_ids
        for sequence in r.sampling_params.bad_words:
            before = len(sequence) - 1
            if before <= len(output) and output[len(output) - before:] == sequence[:-1]:
                pairs.append((row, sequence[-1]))
    if not pairs:
        return None
    rows, tokens = zip(*pairs, strict=True)
    return TokenMask(_on_device(rows, device), _on_device(tokens, device))


def _allowed_ids(params: SamplingParams) -> torch.Tensor:
    if params.allowed_ids is None:
        params.allowed_ids = torch.tensor(params.allowed_token_ids, dtype=torch.long)
    return params.allowed_ids


def _min_tokens_mask(requests: Sequence[ScheduledRequest], eos_token_ids: Sequence[int],
                     device: torch.device) -> TokenMask | None:
    """EOS (unless ignore_eos) and stop ids of rows still short of min_tokens; not for a
    row whose constraint is complete (EOS is all its grammar allows)."""
    pairs = []
    for row, r in enumerate(requests):
        p = r.sampling_params
        if len(r.output_token_ids) >= p.min_tokens:
            continue
        if r.grammar is not None and r.grammar.is_complete:
            continue
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        pairs.extend((row, token) for token in stops)
    if not pairs:
        return None
    rows, tokens = zip(*pairs, strict=True)
    return TokenMask(_on_device(rows, device), _on_device(tokens, device))


def _grammar_mask(requests: Sequence[ScheduledRequest], vocab_size: int,
                  device: torch.device) -> GrammarMask | None:
    """Each constrained row's next-token mask, filled by its matcher on the host as bits
    (token t at bit t % 32 of int32 word t // 32), one bool per token on `device`."""
    rows = [row for row, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return None
    bitmask = np.empty((len(rows), (vocab_size + 31) // 32), dtype=np.int32)
    for k, row in enumerate(rows):
        requests[row].grammar.fill_bitmask(bitmask[k])
    return GrammarMask(_on_device(rows, device), _disallowed(bitmask, vocab_size, device),
                       covers_batch=len(rows) == len(requests))


def _disallowed(bitmask: np.ndarray, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The cleared bits of `bitmask` as bools [rows, vocab_size] on `device`. On the CPU
    numpy unpacks them (a third of the time torch's shifts took, 2.2 -> 0.8 ms for 16 rows
    of the bundled model's vocabulary); elsewhere the packed words go up (32x fewer bytes)
    and are unpacked there. Little-endian word layout, as on every host torch runs on."""
    if device.type == "cpu":
        bits = np.unpackbits(np.invert(bitmask).view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, :vocab_size].view(np.bool_))
    return unpack_disallowed(_moved(torch.from_numpy(bitmask), device), vocab_size)


def unpack_disallowed(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The cleared bits of int32 words [rows, words] as bools [rows, vocab_size], with torch
    ops on the words' device."""
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.view(packed.shape[0], -1)[:, :vocab_size] == 0
