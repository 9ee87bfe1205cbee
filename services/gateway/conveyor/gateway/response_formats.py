"""The two OpenAI response shapes: chat completions and (text) completions.

Each format turns a choice's GenerationDelta into a streaming chunk, and a
finished ChoiceResult into a choice of the non-streaming response.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from conveyor.gateway.engine_records import PositionLogprobs
from conveyor.gateway.generation import GenerationDelta
from conveyor.gateway.logprobs_format import chat_logprobs, completion_logprobs
from conveyor.gateway.usage_totals import UsageTotals


@dataclass(slots=True)
class ChoiceResult:
    """Everything one choice produced, for a non-streaming response."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, delta: GenerationDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


class ResponseFormat:
    """What both shapes share: the envelope and whether logprobs were asked for."""

    chunk_object: str
    response_object: str

    def __init__(self, response_id: str, model: str, num_top_logprobs: int | None):
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.num_top_logprobs = num_top_logprobs
        self._text_offsets: dict[int, int] = {}

    @property
    def wants_logprobs(self) -> bool:
        return self.num_top_logprobs is not None

    def envelope(self, obj: str) -> dict:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model}

    def chunk_of(self, choices: list[dict]) -> dict:
        return {**self.envelope(self.chunk_object), "choices": choices, "usage": None}

    def usage_chunk(self, usage: UsageTotals) -> dict:
        return {**self.envelope(self.chunk_object), "choices": [], "usage": usage.as_openai()}

    def response(self, results: list[ChoiceResult], texts: dict[int, str],
                 usage: UsageTotals) -> dict:
        choices = [self.choice(i, r, texts) for i, r in enumerate(results)]
        return {**self.envelope(self.response_object), "choices": choices,
                "usage": usage.as_openai()}

    def opening_chunks(self, num_choices: int) -> list[dict]:
        return []

    def chunk(self, index: int, delta: GenerationDelta, texts: dict[int, str]) -> dict | None:
        raise NotImplementedError

    def choice(self, index: int, result: ChoiceResult, texts: dict[int, str]) -> dict:
        raise NotImplementedError

    def _next_offset(self, index: int, text: str) -> int:
        """The character offset of this text in its choice (for completion logprobs)."""
        offset = self._text_offsets.get(index, 0)
        self._text_offsets[index] = offset + len(text)
        return offset


class ChatFormat(ResponseFormat):
    chunk_object = "chat.completion.chunk"
    response_object = "chat.completion"

    def opening_chunks(self, num_choices: int) -> list[dict]:
        return [self.chunk_of([_chat_chunk_choice(i, {"role": "assistant", "content": ""})])
                for i in range(num_choices)]

    def chunk(self, index: int, delta: GenerationDelta, texts: dict[int, str]) -> dict | None:
        if not delta.text and delta.finish_reason is None:
            return None
        choice = _chat_chunk_choice(index, {"content": delta.text} if delta.text else {})
        choice["logprobs"] = self._logprobs(delta.token_ids, delta.logprobs, texts)
        choice["finish_reason"] = delta.finish_reason
        choice["stop_reason"] = delta.stop_reason
        return self.chunk_of([choice])

    def choice(self, index: int, result: ChoiceResult, texts: dict[int, str]) -> dict:
        return {
            "index": index,
            "message": {"role": "assistant", "content": result.text},
            "logprobs": self._logprobs(result.token_ids, result.logprobs, texts),
            "finish_reason": result.finish_reason,
            "stop_reason": result.stop_reason,
        }

    def _logprobs(self, token_ids, logprobs, texts) -> dict | None:
        if not self.wants_logprobs:
            return None
        return chat_logprobs(token_ids, logprobs, texts, self.num_top_logprobs)


def _chat_chunk_choice(index: int, delta: dict) -> dict:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}


class CompletionFormat(ResponseFormat):
    chunk_object = "text_completion"
    response_object = "text_completion"

    def chunk(self, index: int, delta: GenerationDelta, texts: dict[int, str]) -> dict | None:
        if not delta.text and delta.finish_reason is None:
            return None
        return self.chunk_of([{
            "index": index,
            "text": delta.text,
            "logprobs": self._logprobs(index, delta.token_ids, delta.logprobs, texts, delta.text),
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }])

    def choice(self, index: int, result: ChoiceResult, texts: dict[int, str]) -> dict:
        return {
            "index": index,
            "text": result.text,
            "logprobs": self._logprobs(index, result.token_ids, result.logprobs, texts,
                                       result.text),
            "finish_reason": result.finish_reason,
            "stop_reason": result.stop_reason,
        }

    def _logprobs(self, index, token_ids, logprobs, texts, text) -> dict | None:
        if not self.wants_logprobs:
            return None
        offset = self._next_offset(index, text)
        return completion_logprobs(token_ids, logprobs, texts, self.num_top_logprobs, offset)
