"""Token counts of a whole response: prompts counted once, completions summed."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.gateway.engine_records import TokenUsage


@dataclass(slots=True)
class UsageTotals:
    """Choice i answers prompt i // n; a prompt's cached count is its first choice's."""

    prompt_lengths: list[int]
    n: int
    completion_tokens: int = 0
    cached_by_prompt: dict[int, int] = field(default_factory=dict)

    def add(self, choice_index: int, usage: TokenUsage) -> None:
        self.completion_tokens += usage.completion_tokens
        if choice_index % self.n == 0:
            self.cached_by_prompt[choice_index // self.n] = usage.cached_tokens

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
