"""One generation request as the scheduler sees it: token ids and a computed-token counter."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conveyor.engine.request_timing import RequestTiming
from conveyor.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from conveyor.engine.core.scheduler_output import PromptTokenLogprob
    from conveyor.engine.lora.adapter import LoraAdapter
    from conveyor.engine.structured.request_grammar import RequestGrammar


class FinishReason(enum.Enum):
    """Why a request stopped; the values are OpenAI's `finish_reason` strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    QUEUE_FULL = "queue_full"
    """Pushed out of a full waiting queue before it ran (engine-internal: the caller gets
    a WaitingQueueFull error, never this as an OpenAI finish_reason)."""


class RequestStatus(enum.Enum):
    """Where a request is. There is no prefill or decode status: that is a counter."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    """Back in the waiting queue after its blocks were taken; it will recompute."""
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)
class Request:
    """A request's tokens and how far the KV cache has caught up with them.

    Invariants: `0 <= num_computed_tokens <= num_tokens`; the KV of positions
    `0 .. num_computed_tokens - 1` is in the request's blocks. Each step the
    scheduler hands the request some of the `num_tokens - num_computed_tokens`
    tokens it still lacks: a whole or partial prompt, or one decode token.
    `block_hashes[i]` is the prefix-cache hash of full block i of
    `all_token_ids` (a memo kept by the KV cache manager). Equality is identity.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    """Lower runs first; ties go to the earlier arrival."""
    cache_salt: str | None = None
    """Mixed into the first block's hash: different salts never share cached blocks."""
    lora: LoraAdapter | None = None
    """The LoRA adapter it runs with (None: the base model); its key is mixed into the first
    block's hash like the salt, and the scheduler keeps a step's adapters within max_loras."""
    arrival_seq: int = 0
    """Arrival order, set by `Scheduler.add_request`; kept across preemptions."""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache at first admission (usage.cached_tokens);
    None until the request is first scheduled."""
    num_preemptions: int = 0
    exempt_from_bounds: bool = False
    """Queued past the waiting bounds and never shed: a later sample of an n > 1 request
    whose first sample was admitted."""
    block_hashes: list[bytes] = field(default_factory=list)
    block_ids: list[int] | None = None
    """Its block table (KVCacheManager fills and frees it): block ids in position order;
    None while it holds no blocks."""
    num_cached_blocks: int = 0
    """Of its table's leading full blocks, how many are entered in the prefix cache."""
    parent_id: str | None = None
    """The caller's request id when it is not `request_id`: sample `sample_index` of an
    n > 1 request runs as its own scheduler request."""
    sample_index: int = 0
    held_samples: list[Request] = field(default_factory=list)
    """Samples 1..n-1 of its caller request, held until this one (sample 0) has computed the
    prompt they share (EngineCore submits them on its first delta), with the prefix cache on."""
    timing: RequestTiming = field(default_factory=lambda: RequestTiming(time.monotonic()))
    """When things happened to it (EngineCore writes it; its trace spans are cut from it)."""
    num_draft_tokens: int = 0
    """Draft tokens its steps verified (speculative decoding), over its life."""
    num_accepted_tokens: int = 0
    """Of those, the ones accepted: output tokens gained without a step of their own."""
    draft_limit: int | None = None
    """Most drafts its next step verifies, adapted to how many it accepted last time
    (None: the configured num_speculative_tokens)."""
    pending_prompt_logprobs: list[PromptTokenLogprob] | None = None
    """Its prompt logprobs computed so far (it asked for them), until the delta with its
    first token carries them; dropped when it is preempted (its prompt runs again)."""
    grammar: RequestGrammar | None = None
    """Its structured-output constraint (sampling_params.structured_outputs) once EngineCore
    has asked for its grammar; the scheduler passes the request over until it has started."""

    @property
    def caller_id(self) -> str:
        """The request id its caller knows (the parent's, for a sample of n > 1)."""
        return self.parent_id if self.parent_id is not None else self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Known tokens whose KV is not in the cache yet (1 for a decoding request)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output, as a new list (O(n): use `token_ids_in` on hot paths)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_waiting(self) -> bool:
        return self.status is RequestStatus.WAITING or self.status is RequestStatus.PREEMPTED

    @property
    def is_awaiting_grammar(self) -> bool:
        """Constrained, and its grammar has not compiled yet (vLLM's WAITING_FOR_FSM)."""
        return self.grammar is not None and not self.grammar.is_started

    @property
    def may_be_shed(self) -> bool:
        """Only a request that never ran (not a preempted one, whose caller has seen tokens)
        may be pushed out of a full waiting queue."""
        return self.status is RequestStatus.WAITING and not self.exempt_from_bounds

    def token_ids_in(self, start: int, end: int) -> list[int]:
        """Tokens at positions start .. end - 1 of prompt + output, without joining them."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def finish(self, reason: FinishReason) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
