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


class InvalidSchedulerConfig(ValueError):
    """A scheduler setting is out of range; the message names the setting."""
