"""What the gateway sends to and reads from a detok stream, as plain data (no protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class DetokOptions:
    """Options of one detok stream (its first message)."""

    request_id: str
    prompt_tail_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


@dataclass(slots=True)
class StopMatch:
    """A stop string matched after `num_tokens` output tokens."""

    stop: str
    stop_index: int
    num_tokens: int


@dataclass(slots=True)
class DetokReply:
    """Text the detok stream produced; `num_tokens` output tokens are consumed so far."""

    text_delta: str
    num_tokens: int
    stop_match: StopMatch | None = None
