"""The result of one offline request (vLLM's RequestOutput shape) and its token usage."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.engine.completion_output import CompletionOutput


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class RequestOutput:
    """A prompt and its `n` completions; `prompt` is None when given as token ids."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (the most of any sample)."""

    @property
    def finished(self) -> bool:
        return all(output.finished for output in self.outputs)

    @property
    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.prompt_token_ids),
                     completion_tokens=sum(len(o.token_ids) for o in self.outputs),
                     cached_tokens=self.num_cached_tokens)
