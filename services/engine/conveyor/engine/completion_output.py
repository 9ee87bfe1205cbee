"""One generated sequence of an offline request (vLLM's CompletionOutput shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """Sample `index` of a request: its text, token ids and why it stopped.

    `finish_reason` is "stop" (EOS or a stop token, whose id is `stop_reason`),
    "length" (max_tokens or max_model_len) or "abort". `logprobs` has one
    {token_id: logprob} per generated token (the sampled one and the top
    alternatives) when the request asked for logprobs, else None.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
