"""Incremental detokenization for the baseline server: append-only text deltas."""

from __future__ import annotations


class IncrementalText:
    """Decodes a growing list of token ids and returns only the new text each time.

    A trailing U+FFFD (an incomplete UTF-8 character) is held back until the next
    token completes it, so no delta is ever taken back.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.full = ""

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        return self._advance(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _advance(self, text: str) -> str:
        delta = text[len(self.full):] if text.startswith(self.full) else ""
        self.full = text if text.startswith(self.full) else self.full
        return delta
