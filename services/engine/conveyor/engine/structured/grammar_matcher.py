"""One sample's place in its grammar: which tokens may come next, and advancing by one."""

from __future__ import annotations

import logging

import llguidance
import numpy as np

log = logging.getLogger("conveyor.engine.structured")


class GrammarMatcher:
    """An llguidance matcher that has consumed a sample's output so far.

    Used by the engine loop thread only: the sampler fills its mask, the scheduler
    advances it by each sampled token. A token outside the mask puts it in an error
    state, where its mask allows only EOS (the sampler never draws one outside it).
    """

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> None:
        """Advance by a sampled token."""
        if not self._matcher.consume_token(token_id):
            log.warning("grammar rejected sampled token %d: %s", token_id,
                        self._matcher.get_error())

    def accept_all(self, token_ids: list[int]) -> str | None:
        """Advance by output produced before (a resumed request); the library's error
        when the tokens break the grammar, else None."""
        if token_ids and not self._matcher.consume_tokens(token_ids):
            return self._matcher.get_error()
        return None

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the next token's mask into `row` (int32, one bit per vocabulary entry,
        token t at bit t % 32 of word t // 32)."""
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    @property
    def is_complete(self) -> bool:
        """No token but EOS can follow: the output is a whole match."""
        return self._matcher.is_stopped()
