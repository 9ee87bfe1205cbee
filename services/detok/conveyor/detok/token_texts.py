"""The texts logprobs show: each token id decoded alone (OpenAI's logprob `token`)."""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

MAX_CACHED_TOKENS = 262_144
"""Token texts kept (a vocabulary of up to this many ids is kept whole)."""


class TokenTexts:
    """The text of single tokens: `tokenizer.decode([id], skip_special_tokens=False)`,
    special tokens kept (what the tokenizer service's per-token Decode gives), the
    `max_entries` most recently used kept. One per process, shared by its streams."""

    def __init__(self, tokenizer, max_entries: int = MAX_CACHED_TOKENS):
        self._text = lru_cache(maxsize=max_entries)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))

    def texts(self, token_ids: Iterable[int]) -> dict[int, str]:
        """The text of each id in `token_ids`, each once."""
        return {token_id: self._text(token_id) for token_id in dict.fromkeys(token_ids)}

