"""The incremental detokenizer of one stream: output tokens in, text out."""

from __future__ import annotations

from conveyor.detok.decode_options import (
    DecodeOptions,
    added_token_ids,
    id_decoder,
    special_token_ids,
)
from conveyor.detok.incremental_decoder import REPLACEMENT_CHAR, IncrementalDecoder

MAX_CONTEXT_TOKENS = 6
"""Prompt tokens kept as decoding context for the first output tokens."""


class Detokenizer:
    """Append-only text of a stream's output tokens.

    At any finish, the concatenation of everything `append` and `flush`
    returned equals `decode_full(tokenizer, output_ids, options)`. The
    prompt's last tokens only serve as context (leading spaces, byte
    boundaries); their text is never returned. A prompt that ends inside a
    UTF-8 character does not lend its bytes to the output: that context is
    dropped, so the output's first bytes decode as they do on their own.

    With `spaces_between_special_tokens`, each added token ends the current
    run of ordinary tokens, and non-empty runs and added tokens are joined by
    one space (HF's slow-tokenizer rule).
    """

    def __init__(self, tokenizer, options: DecodeOptions, prompt_tail_ids: list[int]):
        self._options = options
        self._special = special_token_ids(tokenizer)
        self._added = added_token_ids(tokenizer)
        self._decode = id_decoder(tokenizer, options.skip_special_tokens)
        self._run = IncrementalDecoder(self._decode, self._context_of(prompt_tail_ids))
        self._has_text = False
        """Spaced mode: some segment already produced text (the next one needs a space)."""
        self._run_has_text = False

    def append(self, token_id: int) -> str:
        """Add one output token; return the text that became final."""
        if not self._options.spaces_between_special_tokens:
            return self._run.append(token_id)
        if self._options.skip_special_tokens and token_id in self._special:
            return ""
        if token_id in self._added:
            return self._append_added(token_id)
        return self._spaced(self._run.append(token_id))

    def flush(self) -> str:
        """The output is complete: return any held-back text."""
        text = self._run.flush()
        return self._spaced(text) if self._options.spaces_between_special_tokens else text

    def _append_added(self, token_id: int) -> str:
        closing = self._spaced(self._run.flush())
        self._run = IncrementalDecoder(self._decode, [])
        self._run_has_text = False
        token_text = self._decode([token_id])
        if not token_text:
            return closing
        separator = " " if self._has_text else ""
        self._has_text = True
        return closing + separator + token_text

    def _spaced(self, text: str) -> str:
        """A run's delta, preceded by the separator when it is the run's first text."""
        if not text or self._run_has_text:
            return text
        self._run_has_text = True
        separator = " " if self._has_text else ""
        self._has_text = True
        return separator + text

    def _context_of(self, prompt_tail_ids: list[int]) -> list[int]:
        """The prompt tokens that share the first output run, cut back to a
        whole-character boundary."""
        ids = list(prompt_tail_ids)
        if self._options.skip_special_tokens:
            ids = [i for i in ids if i not in self._special]
        if self._options.spaces_between_special_tokens:
            ids = _after_last(ids, self._added)
        ids = ids[-MAX_CONTEXT_TOKENS:]
        while ids and self._decode(ids).endswith(REPLACEMENT_CHAR):
            ids.pop()
        return ids


def _after_last(ids: list[int], marks: frozenset[int]) -> list[int]:
    for index in range(len(ids) - 1, -1, -1):
        if ids[index] in marks:
            return ids[index + 1:]
    return ids
