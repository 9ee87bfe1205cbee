"""Token id -> text, for logprobs: the ids a response needs that are not cached yet are
asked of the tokenizer in one Decode call (each_token), and the texts kept in an LRU;
used only by requests that ask for logprobs, so the hot path never waits on it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from conveyor.gateway.clients.tokenizer import TokenizerClient


class TokenTexts:
    """The texts of single tokens (special tokens kept), the `max_entries` most recently
    used ids kept: a lookup or an arrival moves an id to the back, the front goes first."""

    def __init__(self, tokenizer: TokenizerClient, max_entries: int = 262_144):
        self._tokenizer = tokenizer
        self._texts: OrderedDict[int, str] = OrderedDict()
        self._max_entries = max_entries

    async def texts(self, token_ids: Iterable[int]) -> dict[int, str]:
        """The text of each id in token_ids; one Decode call for those not cached."""
        wanted = list(dict.fromkeys(token_ids))
        found = {i: self._texts[i] for i in wanted if i in self._texts}  # before any await
        missing = [i for i in wanted if i not in found]
        if missing:
            found.update(zip(missing, await self._tokenizer.decode_each(missing), strict=True))
        for token_id, text in found.items():
            self._texts[token_id] = text
            self._texts.move_to_end(token_id)
        while len(self._texts) > self._max_entries:
            self._texts.popitem(last=False)
        return {i: found[i] for i in wanted}
