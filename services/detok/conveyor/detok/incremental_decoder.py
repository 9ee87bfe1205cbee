"""Incremental decoding of one run of tokens with prefix/read offsets."""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDecoder:
    """Turns tokens appended one at a time into append-only text.

    Each step decodes only a short window: the tokens from `prefix_offset`
    (already emitted, kept as context so spaces and multi-byte characters
    decode as they would in the whole text) to the end. The text of the tokens
    after `read_offset` is the new part. Trailing U+FFFD characters are held
    back until a later token completes them (or `flush` is called), so no text
    is ever taken back. When the window decodes cleanly both offsets move up,
    which keeps the window a few tokens long.

    Invariant: the text before `read_offset` has been emitted and the bytes
    up to it form complete characters, so the window's new part decodes as
    it does in the whole text.
    """

    def __init__(self, decode: Callable[[list[int]], str], context_ids: list[int]):
        self._decode = decode
        self._ids = list(context_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._emitted = ""
        """Text of the tokens after read_offset already emitted while their tail was held."""

    def append(self, token_id: int) -> str:
        """Add one token; return the text that became final."""
        self._ids.append(token_id)
        return self._step(final=False)

    def flush(self) -> str:
        """The run ends: return the held-back text, U+FFFD included."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset:])
        if not window_text.startswith(prefix_text):
            return ""  # a decoder that rewrites earlier text: wait for more context
        new_text = window_text[len(prefix_text):]
        ready = new_text if final else new_text.rstrip(REPLACEMENT_CHAR)
        if not ready.startswith(self._emitted):
            return ""
        delta = ready[len(self._emitted):]
        if ready == new_text:
            self._advance()
        else:
            self._emitted = ready
        return delta

    def _advance(self) -> None:
        """Everything up to the end is emitted: the last step's tokens become context."""
        del self._ids[:self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._emitted = ""
