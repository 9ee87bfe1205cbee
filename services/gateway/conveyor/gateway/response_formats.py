"""The two OpenAI response shapes (chat completions and text completions), their logprobs,
and the usage of a whole response.

Each format turns a choice's GenerationDelta into a streaming chunk, and a finished
ChoiceResult into a choice of the non-streaming response; `UsageTotals` counts the
tokens of all the choices (prompts once, completions summed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from conveyor.gateway.generation import GenerationDelta
from conveyor.gateway.wire import PositionLogprobs, TokenUsage, ToolCallDelta

# -- usage totals ------------------------------------------------------------------------

@dataclass(slots=True)
class UsageTotals:
    """Choice i answers prompt i // n; a prompt's cached count is its first choice's.

    `completion_tokens` sums the engine's final counts of finished choices;
    `num_tokens_seen` counts every output token that arrived, finished or not
    (what a request that was cut short has spent)."""

    prompt_lengths: list[int]
    n: int
    completion_tokens: int = 0
    num_tokens_seen: int = 0
    cached_by_prompt: dict[int, int] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)

    def observe(self, choice_index: int, delta: GenerationDelta) -> None:
        """Count one delta of choice `choice_index`; its last one brings the usage."""
        self.num_tokens_seen += len(delta.token_ids)
        if delta.finish_reason is not None:
            self.finish_reasons[choice_index] = delta.finish_reason
        if delta.usage is not None:
            self.add(choice_index, delta.usage)

    def add(self, choice_index: int, usage: TokenUsage) -> None:
        self.completion_tokens += usage.completion_tokens
        if choice_index % self.n == 0:
            self.cached_by_prompt[choice_index // self.n] = usage.cached_tokens

    @property
    def num_tokens_spent(self) -> int:
        """Output tokens to charge: the engine's counts, or what arrived if more."""
        return max(self.completion_tokens, self.num_tokens_seen)

    @property
    def finish_reason(self) -> str | None:
        """The choices' finish reasons, comma-joined in choice order (None: none finished)."""
        reasons = [self.finish_reasons[i] for i in sorted(self.finish_reasons)]
        return ",".join(reasons) if reasons else None

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_lengths)

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached_by_prompt.values())

    def as_openai(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


# -- logprobs format ---------------------------------------------------------------------

def needed_token_ids(token_ids: list[int], logprobs: list[PositionLogprobs]) -> set[int]:
    """Every id whose text the logprobs below will show."""
    ids = set(token_ids)
    for position in logprobs:
        ids.update(token_id for token_id, _ in position.top)
    return ids


def chat_logprobs(
    token_ids: list[int], logprobs: list[PositionLogprobs], texts: dict[int, str],
    num_top: int,
) -> dict:
    """`{"content": [...]}` for a chat choice or chunk."""
    return {"content": [
        {**_chat_entry(texts[token_id], position.logprob),
         "top_logprobs": [_chat_entry(texts[i], lp) for i, lp in position.top[:num_top]]}
        for token_id, position in zip(token_ids, logprobs, strict=False)
    ]}


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}


def completion_logprobs(
    token_ids: list[int], logprobs: list[PositionLogprobs], texts: dict[int, str],
    num_top: int, text_offset: int,
) -> dict:
    """The completions shape; offsets count characters of the choice's text from text_offset."""
    tokens = [texts[token_id] for token_id in token_ids[: len(logprobs)]]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(p.logprob) for p in logprobs[: len(tokens)]],
        "top_logprobs": [
            {texts[i]: _finite(lp) for i, lp in p.top[:num_top]} for p in logprobs[: len(tokens)]
        ],
        "text_offset": offsets,
    }


def _finite(logprob: float) -> float:
    """JSON has no -inf; OpenAI servers send a very small number instead."""
    return max(logprob, -9999.0)


# -- response formats --------------------------------------------------------------------

@dataclass(slots=True)
class ChoiceResult:
    """Everything one choice produced, for a non-streaming response."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    tool_calls: list[dict] = field(default_factory=list)
    """OpenAI's `message.tool_calls`, assembled from the pieces."""

    def add(self, delta: GenerationDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        for piece in delta.tool_calls:
            if piece.id:
                self.tool_calls.append({"id": piece.id, "type": "function",
                                        "function": {"name": piece.name, "arguments": ""}})
            else:
                self.tool_calls[piece.index]["function"]["arguments"] += piece.arguments
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def _tool_call_entry(piece: ToolCallDelta) -> dict:
    """One entry of a streamed `delta.tool_calls`: a call's header, or an arguments piece."""
    if piece.id:
        return {"index": piece.index, "id": piece.id, "type": "function",
                "function": {"name": piece.name, "arguments": ""}}
    return {"index": piece.index, "function": {"arguments": piece.arguments}}


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for a choice that ended by itself after calling tools."""
    return "tool_calls" if reason == "stop" and called else reason


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

    def chunks(self, index: int, delta: GenerationDelta, texts: dict[int, str]) -> list[dict]:
        """The streamed chunks of one delta (none when it carries nothing to show)."""
        raise NotImplementedError

    def choice(self, index: int, result: ChoiceResult, texts: dict[int, str]) -> dict:
        raise NotImplementedError

    def _next_offset(self, index: int, text: str) -> int:
        """The character offset of this text in its choice (for completion logprobs)."""
        offset = self._text_offsets.get(index, 0)
        self._text_offsets[index] = offset + len(text)
        return offset


class ChatFormat(ResponseFormat):
    """Chat completions. A delta's content (with its logprobs) is one chunk and each of
    its tool-call pieces one more (a call's id and name first, then its arguments), as
    OpenAI streams them; a choice that called tools and ended by itself finishes with
    "tool_calls"."""

    chunk_object = "chat.completion.chunk"
    response_object = "chat.completion"

    def __init__(self, response_id: str, model: str, num_top_logprobs: int | None):
        super().__init__(response_id, model, num_top_logprobs)
        self._called: set[int] = set()
        """Choices that streamed a tool call."""

    def opening_chunks(self, num_choices: int) -> list[dict]:
        return [self.chunk_of([_chat_chunk_choice(i, {"role": "assistant", "content": ""})])
                for i in range(num_choices)]

    def chunks(self, index: int, delta: GenerationDelta, texts: dict[int, str]) -> list[dict]:
        deltas = [{"content": delta.text}] if delta.text else []
        deltas += [{"tool_calls": [_tool_call_entry(piece)]} for piece in delta.tool_calls]
        if delta.tool_calls:
            self._called.add(index)
        if not deltas and delta.finish_reason is None:
            return []
        choices = [{**_chat_chunk_choice(index, d), "stop_reason": None} for d in deltas or [{}]]
        choices[0]["logprobs"] = self._logprobs(delta.token_ids, delta.logprobs, texts)
        if delta.finish_reason is not None:
            choices[-1]["finish_reason"] = _finish_reason(delta.finish_reason,
                                                          index in self._called)
            choices[-1]["stop_reason"] = delta.stop_reason
        return [self.chunk_of([choice]) for choice in choices]

    def choice(self, index: int, result: ChoiceResult, texts: dict[int, str]) -> dict:
        message = {"role": "assistant", "content": result.text}
        if result.tool_calls:
            message = {"role": "assistant", "content": result.text or None,
                       "tool_calls": result.tool_calls}
        return {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(result.token_ids, result.logprobs, texts),
            "finish_reason": _finish_reason(result.finish_reason, bool(result.tool_calls)),
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

    def chunks(self, index: int, delta: GenerationDelta, texts: dict[int, str]) -> list[dict]:
        if not delta.text and delta.finish_reason is None:
            return []
        return [self.chunk_of([{
            "index": index,
            "text": delta.text,
            "logprobs": self._logprobs(index, delta.token_ids, delta.logprobs, texts, delta.text),
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }])]

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
