"""Errors the engine core raises on bad input or bad settings (ValueErrors, never asserts)."""

from __future__ import annotations


class RequestTooLong(ValueError):
    """prompt tokens + max_tokens exceed max_model_len; the message names all three numbers."""

    def __init__(
        self, request_id: str, num_prompt_tokens: int, max_tokens: int, max_model_len: int
    ) -> None:
        super().__init__(
            f"request {request_id!r}: prompt of {num_prompt_tokens} tokens + max_tokens "
            f"{max_tokens} = {num_prompt_tokens + max_tokens} tokens exceeds max_model_len "
            f"{max_model_len}; shorten the prompt or lower max_tokens"
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class DuplicateRequestId(ValueError):
    """A request id is already live in the scheduler."""


class KVCacheTooSmall(ValueError):
    """The block pool cannot hold one max_model_len sequence; the message says what to change."""


class InvalidEngineConfig(ValueError):
    """An engine setting is out of range; the message names the setting."""


class WaitingQueueFull(Exception):
    """The waiting queue is at its bound: a request was refused on arrival, or pushed out
    by a higher-priority arrival. Not the caller's fault: it may retry later or elsewhere.

    The message names the bounds; `pushed_out` says which of the two happened.
    """

    def __init__(self, max_num_seqs: int | None, max_num_tokens: int | None,
                 pushed_out: bool = False) -> None:
        seqs = "unlimited" if max_num_seqs is None else max_num_seqs
        tokens = "unlimited" if max_num_tokens is None else max_num_tokens
        cause = "pushed out by a higher-priority request: " if pushed_out else ""
        super().__init__(f"{cause}the engine's waiting queue is full ({seqs} requests / "
                         f"{tokens} tokens); retry later")
        self.pushed_out = pushed_out
