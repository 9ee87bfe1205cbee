"""The OpenAI response shapes of chat completions and text completions.

Each format turns a choice's GenerationDelta into streaming chunks, and finished
ChoiceResults into the non-streaming response; it also says how its stream is framed
(SSE `data:` lines ending in `data: [DONE]`, the Responses API's named events); its
logprobs (logprob_entries.py) show the token texts detok sent with the deltas;
usage_totals.py counts the usage."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

from conveyor.gateway.clients.detok import GenerationDelta, ToolCallDelta
from conveyor.gateway.clients.engine import PositionLogprobs
from conveyor.gateway.clients.tokenizer import PromptTokens
from conveyor.gateway.errors import APIError
from conveyor.gateway.logprob_entries import (
    _joined_logprobs,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    prompt_logprobs_entries,
)
from conveyor.gateway.usage_totals import UsageTotals, usage_so_far

OBFUSCATION_BLOCK = 32
"""A content chunk's text and its obfuscation fill a multiple of this many bytes."""


def obfuscation(text: str) -> str:
    """Random URL-safe characters that pad `text` (in UTF-8 bytes) to a multiple of
    OBFUSCATION_BLOCK, so a chunk's size does not tell its text's length."""
    num_chars = OBFUSCATION_BLOCK - len(text.encode()) % OBFUSCATION_BLOCK
    return secrets.token_urlsafe(num_chars)[:num_chars]


DONE = b"data: [DONE]\n\n"


def encode_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """What a request asks of its response beyond its choices' text and logprobs."""

    n: int = 1
    include_usage: bool = False
    """A last chunk with the whole request's usage."""
    continuous_usage: bool = False
    """Every chunk with its choice's usage so far (vLLM's continuous_usage_stats)."""
    obfuscate: bool = False
    """Content chunks padded with an `obfuscation` field (OpenAI's include_obfuscation)."""
    served_tier: str | None = None
    """The service_tier the response names (when the request named one)."""
    num_prompt_logprobs: int | None = None
    """vLLM's prompt_logprobs shown, with this many alternatives (None: not shown)."""
    echo: bool = False
    """Completions: the prompt before each choice's text."""
    chat_echo: str = ""
    """Chat: the text before each choice's content (vLLM's echo of an assistant's turn)."""
    token_ids: bool = False
    """vLLM's return_token_ids: prompt_token_ids and each choice's token_ids (streamed: each
    chunk's own, a chunk even for tokens whose text is held back, so they add up)."""


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
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)

    def add(self, delta: GenerationDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.prompt_logprobs.extend(delta.prompt_logprobs)
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
    """What the shapes share: the envelope, the SSE framing and the options of
    `OutputOptions`. `prompts` are the request's prompts in order (choice i answers
    prompt i // n). The token texts its logprobs show come with the deltas (detok's)."""

    chunk_object: str
    response_object: str

    def __init__(self, response_id: str, model: str, num_top_logprobs: int | None,
                 options: OutputOptions = OutputOptions(),
                 prompts: list[PromptTokens] | None = None):
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.num_top_logprobs = num_top_logprobs
        self.options = options
        self.prompts = prompts or []
        self._text_offsets: dict[int, int] = {}
        self._num_tokens: dict[int, int] = {}
        """Tokens streamed so far, by choice (for continuous usage)."""

    @property
    def wants_logprobs(self) -> bool:
        return self.num_top_logprobs is not None

    def envelope(self, obj: str) -> dict:
        envelope = {"id": self.response_id, "object": obj, "created": self.created,
                    "model": self.model}
        if self.options.served_tier is not None:
            envelope["service_tier"] = self.options.served_tier
        return envelope

    def chunk_of(self, choices: list[dict]) -> dict:
        return {**self.envelope(self.chunk_object), "choices": choices, "usage": None}

    def usage_chunk(self, usage: UsageTotals) -> dict:
        return {**self.envelope(self.chunk_object), "choices": [], "usage": usage.as_openai()}

    def response(self, results: list[ChoiceResult], texts: dict[int, str],
                 usage: UsageTotals) -> dict:
        choices = [self.choice(i, r, texts) for i, r in enumerate(results)]
        return {**self.envelope(self.response_object), "choices": choices,
                "usage": usage.as_openai()}

    # -- the stream ---------------------------------------------------------------------

    def opening_chunks(self, num_choices: int) -> list[dict]:
        return []

    def delta_chunks(self, index: int, delta: GenerationDelta,
                     texts: dict[int, str]) -> list[dict]:
        """The chunks of one delta of choice `index`, each with that choice's usage so far
        when continuous usage was asked for."""
        self._num_tokens[index] = self._num_tokens.get(index, 0) + len(delta.token_ids)
        chunks = self.chunks(index, delta, texts)
        if self.options.continuous_usage:
            for chunk in chunks:
                chunk["usage"] = self._choice_usage(index)
        return chunks

    def chunks(self, index: int, delta: GenerationDelta, texts: dict[int, str]) -> list[dict]:
        """The streamed chunks of one delta (none when it carries nothing to show)."""
        raise NotImplementedError

    def closing_chunks(self, usage: UsageTotals) -> list[dict]:
        """What the stream sends after every choice finished (the usage, if asked for)."""
        return [self.usage_chunk(usage)] if self.options.include_usage else []

    def error_chunks(self, error: APIError) -> list[dict]:
        """What a stream that fails after it started sends before it ends."""
        return [error.body()]

    def encode(self, chunk: dict) -> bytes:
        return encode_event(chunk)

    stream_end: bytes = DONE
    """The stream's last bytes."""

    def choice(self, index: int, result: ChoiceResult, texts: dict[int, str]) -> dict:
        raise NotImplementedError

    # -- per choice ---------------------------------------------------------------------

    def _prompt_of(self, index: int) -> PromptTokens:
        return self.prompts[index // self.options.n]

    def _choice_usage(self, index: int) -> dict:
        return usage_so_far(self._prompt_of(index).num_tokens, self._num_tokens.get(index, 0))

    def _prompt_logprobs(self, index: int, positions: list[PositionLogprobs],
                         texts: dict[int, str]) -> list[dict | None]:
        return prompt_logprobs_entries(self._prompt_of(index).token_ids, positions, texts,
                                       self.options.num_prompt_logprobs or 0)

    def _shows_ids(self, delta: GenerationDelta) -> bool:
        """Whether a delta with no text still makes a chunk: its token ids are asked for."""
        return self.options.token_ids and bool(delta.token_ids)

    def _obfuscated(self, chunk: dict, text: str) -> dict:
        if self.options.obfuscate and text:
            chunk["obfuscation"] = obfuscation(text)
        return chunk

    def _next_offset(self, index: int, text: str) -> int:
        """The character offset of this text in its choice (for completion logprobs)."""
        offset = self._text_offsets.get(index, 0)
        self._text_offsets[index] = offset + len(text)
        return offset


def prompt_logprobs_by_prompt(results: list[ChoiceResult], n: int
                              ) -> dict[int, list[PositionLogprobs]]:
    """Each prompt's logprobs, from whichever of its choices carried them (sample 0)."""
    found: dict[int, list[PositionLogprobs]] = {}
    for index, result in enumerate(results):
        if result.prompt_logprobs:
            found.setdefault(index // n, result.prompt_logprobs)
    return found


class ChatFormat(ResponseFormat):
    """Chat completions. A delta's content (with its logprobs) is one chunk and each of
    its tool-call pieces one more (a call's id and name first, then its arguments), as
    OpenAI streams them; a choice that called tools and ended by itself finishes with
    "tool_calls". vLLM's prompt_logprobs are a field of the response (not of a choice)."""

    chunk_object = "chat.completion.chunk"
    response_object = "chat.completion"

    def __init__(self, response_id: str, model: str, num_top_logprobs: int | None,
                 options: OutputOptions = OutputOptions(),
                 prompts: list[PromptTokens] | None = None):
        super().__init__(response_id, model, num_top_logprobs, options, prompts)
        self._called: set[int] = set()
        """Choices that streamed a tool call."""

    def opening_chunks(self, num_choices: int) -> list[dict]:
        opening = {"role": "assistant", "content": self.options.chat_echo}
        chunks = [self.chunk_of([_chat_chunk_choice(i, opening)]) for i in range(num_choices)]
        if self.options.token_ids and chunks:
            chunks[0]["prompt_token_ids"] = self._prompt_of(0).token_ids
        if self.options.continuous_usage:
            for index, chunk in enumerate(chunks):
                chunk["usage"] = self._choice_usage(index)
        return chunks

    def chunks(self, index: int, delta: GenerationDelta, texts: dict[int, str]) -> list[dict]:
        deltas = [{"content": delta.text}] if delta.text else []
        deltas += [{"tool_calls": [_tool_call_entry(piece)]} for piece in delta.tool_calls]
        if delta.tool_calls:
            self._called.add(index)
        if not deltas and delta.finish_reason is None and not self._shows_ids(delta):
            return []
        choices = [{**_chat_chunk_choice(index, d), "stop_reason": None} for d in deltas or [{}]]
        choices[0]["logprobs"] = self._logprobs(delta.token_ids, delta.logprobs, texts)
        if self.options.token_ids:
            choices[0]["token_ids"] = delta.token_ids
        if delta.finish_reason is not None:
            choices[-1]["finish_reason"] = _finish_reason(delta.finish_reason,
                                                          index in self._called)
            choices[-1]["stop_reason"] = delta.stop_reason
        chunks = [self.chunk_of([choice]) for choice in choices]
        self._obfuscated(chunks[0], delta.text)
        return chunks

    def response(self, results: list[ChoiceResult], texts: dict[int, str],
                 usage: UsageTotals) -> dict:
        body = super().response(results, texts, usage)
        if self.options.num_prompt_logprobs is not None:
            positions = prompt_logprobs_by_prompt(results, self.options.n).get(0, [])
            body["prompt_logprobs"] = self._prompt_logprobs(0, positions, texts)
        if self.options.token_ids:
            body["prompt_token_ids"] = self._prompt_of(0).token_ids
        return body

    def choice(self, index: int, result: ChoiceResult, texts: dict[int, str]) -> dict:
        content = self.options.chat_echo + result.text
        message = {"role": "assistant", "content": content}
        if result.tool_calls:
            message = {"role": "assistant", "content": content or None,
                       "tool_calls": result.tool_calls}
        choice = {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(result.token_ids, result.logprobs, texts),
            "finish_reason": _finish_reason(result.finish_reason, bool(result.tool_calls)),
            "stop_reason": result.stop_reason,
        }
        if self.options.token_ids:
            choice["token_ids"] = result.token_ids
        return choice

    def _logprobs(self, token_ids, logprobs, texts) -> dict | None:
        if not self.wants_logprobs:
            return None
        return chat_logprobs(token_ids, logprobs, texts, self.num_top_logprobs)


def _chat_chunk_choice(index: int, delta: dict) -> dict:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}


class CompletionFormat(ResponseFormat):
    """Text completions. With echo, each choice's text starts with its prompt (and, with
    logprobs, its logprobs with the prompt's: the first prompt token has none); vLLM's
    prompt_logprobs are a field of each choice."""

    chunk_object = "text_completion"
    response_object = "text_completion"

    def __init__(self, response_id: str, model: str, num_top_logprobs: int | None,
                 options: OutputOptions = OutputOptions(),
                 prompts: list[PromptTokens] | None = None):
        super().__init__(response_id, model, num_top_logprobs, options, prompts)
        self._echoed: set[int] = set()
        self._shown_prompt: set[int] = set()
        """Choices whose prompt_token_ids were streamed (return_token_ids)."""

    def chunks(self, index: int, delta: GenerationDelta, texts: dict[int, str]) -> list[dict]:
        echoes = self._echoes_next(index)
        if not delta.text and delta.finish_reason is None and not echoes \
                and not self._shows_ids(delta):
            return []
        prefix, prefix_logprobs = self._echo(index, delta.prompt_logprobs, texts) if echoes \
            else ("", None)
        text = prefix + delta.text
        logprobs = self._logprobs(index, delta.token_ids, delta.logprobs, texts, delta.text)
        choice = {
            "index": index,
            "text": text,
            "logprobs": _joined_logprobs(prefix_logprobs, logprobs),
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }
        if self.options.token_ids:
            if index not in self._shown_prompt:
                self._shown_prompt.add(index)
                choice["prompt_token_ids"] = self._prompt_of(index).token_ids
            choice["token_ids"] = delta.token_ids
        return [self._obfuscated(self.chunk_of([choice]), text)]

    def response(self, results: list[ChoiceResult], texts: dict[int, str],
                 usage: UsageTotals) -> dict:
        by_prompt = prompt_logprobs_by_prompt(results, self.options.n)
        for index, result in enumerate(results):
            result.prompt_logprobs = by_prompt.get(index // self.options.n, [])
        return super().response(results, texts, usage)

    def choice(self, index: int, result: ChoiceResult, texts: dict[int, str]) -> dict:
        prefix, prefix_logprobs = self._echo(index, result.prompt_logprobs, texts) \
            if self.options.echo else ("", None)
        logprobs = self._logprobs(index, result.token_ids, result.logprobs, texts, result.text)
        choice = {
            "index": index,
            "text": prefix + result.text,
            "logprobs": _joined_logprobs(prefix_logprobs, logprobs),
            "finish_reason": result.finish_reason,
            "stop_reason": result.stop_reason,
        }
        if self.options.num_prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(index, result.prompt_logprobs,
                                                              texts)
        if self.options.token_ids:
            choice["prompt_token_ids"] = self._prompt_of(index).token_ids
            choice["token_ids"] = result.token_ids
        return choice

    def _echoes_next(self, index: int) -> bool:
        return self.options.echo and index not in self._echoed

    def _echo(self, index: int, positions: list[PositionLogprobs],
              texts: dict[int, str]) -> tuple[str, dict | None]:
        """The prompt's text, and its logprobs when logprobs are shown (the offsets of the
        text after it then go on from its tokens')."""
        self._echoed.add(index)
        prompt = self._prompt_of(index)
        if not self.wants_logprobs:
            return prompt.prompt_text, None
        logprobs = echo_logprobs(prompt.token_ids, positions, texts, self.num_top_logprobs)
        self._text_offsets[index] = sum(len(token) for token in logprobs["tokens"])
        return prompt.prompt_text, logprobs

    def _logprobs(self, index, token_ids, logprobs, texts, text) -> dict | None:
        if not self.wants_logprobs:
            return None
        offset = self._next_offset(index, text)
        return completion_logprobs(token_ids, logprobs, texts, self.num_top_logprobs, offset)
