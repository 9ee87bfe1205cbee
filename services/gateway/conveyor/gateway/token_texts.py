"""Token id -> text, for logprobs. Asked of the tokenizer (Decode) once per id and
kept; used only by requests that ask for logprobs, so the hot path never waits on it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from conveyor.gateway.text_services import TokenizerClient


class TokenTexts:
    """A cache of single-token texts (special tokens kept), at most `max_entries` ids."""

    def __init__(self, tokenizer: TokenizerClient, max_entries: int = 262_144):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._max_entries = max_entries

    async def texts(self, token_ids: Iterable[int]) -> dict[int, str]:
        """The text of each id in token_ids."""
        wanted = set(token_ids)
        missing = [i for i in wanted if i not in self._texts]
        decoded = dict(zip(missing, await asyncio.gather(
            *(self._tokenizer.decode([i]) for i in missing)), strict=True))
        if len(self._texts) + len(decoded) <= self._max_entries:
            self._texts.update(decoded)
        return {i: self._texts[i] if i in self._texts else decoded[i] for i in wanted}
