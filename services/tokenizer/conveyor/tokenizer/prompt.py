"""Plain prompts in, tokenized prompts out (domain types of Tokenize and Render)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TextPrompt:
    """Text to tokenize."""

    text: str
    add_special_tokens: bool = False
    max_tokens: int = 0
    max_model_len: int | None = None
    """The context length to check against (the engines'); None: the model's own."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last k tokens (-1: the last max_model_len); None: all."""
    bad_words: tuple[str, ...] = ()
    """vLLM's bad_words, tokenized with the prompt (TokenizedPrompt.bad_words)."""


@dataclass(frozen=True, slots=True)
class TokenIdsPrompt:
    """Token ids given directly; they are checked, not changed."""

    token_ids: list[int]
    max_tokens: int = 0
    max_model_len: int | None = None
    """The context length to check against (the engines'); None: the model's own."""
    truncate_prompt_tokens: int | None = None
    """As TextPrompt's."""
    bad_words: tuple[str, ...] = ()
    """As TextPrompt's."""


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    """A validated prompt: it fits max_model_len with its max_tokens."""

    token_ids: list[int]
    prompt_text: str
    max_model_len: int
    """The context length it was checked against."""
    bad_words: list[list[int]] = field(default_factory=list)
    """The token sequences of the request's bad_words (PromptTokenizer.bad_word_sequences)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
