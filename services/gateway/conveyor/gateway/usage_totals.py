"""The usage of a whole response: `UsageTotals` counts the tokens of all its choices
(prompts once, completions summed)."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.gateway.clients.detok import GenerationDelta
from conveyor.gateway.clients.engine import TokenUsage


@dataclass(slots=True)
class UsageTotals:
    """Choice i answers prompt i // n; a prompt's cached count is its first choice's.

    `completion_tokens` sums the engine's final counts of finished choices, and so do
    `draft_tokens` and `accepted_draft_tokens` (speculative decoding; for the timeline,
    not the OpenAI usage); `num_tokens_seen` counts every output token that arrived,
    finished or not (what a request that was cut short has spent)."""

    prompt_lengths: list[int]
    n: int
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    num_tokens_seen: int = 0
    cached_by_prompt: dict[int, int] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)

    def observe(self, choice_index: int, delta: GenerationDelta) -> None:
        """Count one delta of choice `choice_index`; its last one brings the usage."""
        self.num_tokens_seen += len(delta.token_ids)
        if delta.finish_reason is not None:
            self.finish_reasons[choice_index] = delta.finish_reason
        if delta.usage is not None:
            self.add(choice_index, delta.usage)

    def add(self, choice_index: int, usage: TokenUsage) -> None:
        self.completion_tokens += usage.completion_tokens
        self.draft_tokens += usage.draft_tokens
        self.accepted_draft_tokens += usage.accepted_draft_tokens
        if choice_index % self.n == 0:
            self.cached_by_prompt[choice_index // self.n] = usage.cached_tokens

    @property
    def num_tokens_spent(self) -> int:
        """Output tokens to charge: the engine's counts, or what arrived if more."""
        return max(self.completion_tokens, self.num_tokens_seen)

    @property
    def finish_reason(self) -> str | None:
        """The choices' finish reasons, comma-joined in choice order (None: none finished)."""
        reasons = [self.finish_reasons[i] for i in sorted(self.finish_reasons)]
        return ",".join(reasons) if reasons else None

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_lengths)

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached_by_prompt.values())

    def as_openai(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def usage_so_far(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    """vLLM's continuous usage of one choice: its prompt and its tokens so far."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}
