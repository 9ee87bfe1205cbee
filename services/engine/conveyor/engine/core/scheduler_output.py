"""What the scheduler hands the model runner for one step, and what comes back.

Plain data only: the scheduler never touches tensors and the model runner never
decides who runs. Field lists are references into the request (not copies), so
they are valid only until the scheduler's next `schedule()` call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conveyor.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from conveyor.engine.lora.adapter import LoraAdapter
    from conveyor.engine.structured.grammar_matcher import GrammarMatcher


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    `token_ids` are the tokens computed this step: positions
    `num_computed_tokens .. num_computed_tokens + len(token_ids) - 1`.
    `slot_mapping[i]` is the KV slot of token i:
    `block_table[p // block_size] * block_size + p % block_size` for position p.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    slot_mapping: list[int]
    needs_sample: bool
    """True when this step reaches the end of the request's known tokens, so the
    logits of its last token are sampled (false for a non-final prefill chunk)."""
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    lora: LoraAdapter | None = None
    """The adapter its rows run with (None: the base model)."""
    grammar: GrammarMatcher | None = None
    """A constrained request's matcher, at its output so far: the sampler masks the tokens
    it does not allow."""
    num_draft_slots: int = 0
    """KV slots allocated past the known tokens for drafts a draft model is to propose in
    the runner (speculative_method "draft"; worker/draft_proposer.py fills
    `draft_token_ids`); 0 when the scheduler proposed the drafts itself, or none."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Proposed tokens after the known ones, the tail of `token_ids` (speculative decoding):
    the logits of the last known token and of each draft are sampled, and the drafts are
    accepted while they agree with what is sampled (sampling/spec_rows.py)."""

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_sample_rows(self) -> int:
        """Logit rows sampled for it this step: its last known token's and one per draft."""
        return 1 + len(self.draft_token_ids) if self.needs_sample else 0

    @property
    def seq_len(self) -> int:
        """Tokens in the KV cache once this step has run (context length)."""
        return self.num_computed_tokens + len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """A step's batch: running requests first, then newly admitted ones."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    block_size: int = 16
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests that finished or were aborted since the previous step: the model runner
    may drop any per-request state it keeps (seeded generators, cached tensors)."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SampledToken:
    """The model runner's answer for one request that needed a token."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    """(token_id, logprob) pairs, most likely first, when asked for."""


@dataclass(slots=True)
class PromptTokenLogprob:
    """A prompt token's logprob given the tokens before it, its rank (1: the most likely)
    and the `top` alternatives (token_id, logprob), most likely first."""

    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled tokens by request id; requests with needs_sample=False are absent. Each
    request gained one token, or with drafts the accepted drafts and the token after them."""

    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PromptTokenLogprob]] = field(default_factory=dict)
    """For requests that asked for prompt logprobs, those of the prompt positions this
    step computed (in order; see worker/prompt_logprobs.py)."""
    failures: dict[str, str] = field(default_factory=dict)
    """Requests the model failed on (IsolatingRunner pins a failure on them), with the
    error their caller gets: they end with finish ABORT and this error."""
