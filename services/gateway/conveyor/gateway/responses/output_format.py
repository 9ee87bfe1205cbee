"""The Responses API's output: the Response object, and its stream of named events.

One choice; its output is a list of items: a `message` (role assistant, one
`output_text` part) for its text, one `function_call` per tool call. Streamed as the
official SDK reads them, each event an SSE `event: <type>` line and a `data:` line, its
`sequence_number` counting from 0, and no `[DONE]`:

    response.created, response.in_progress                   (status in_progress)
    per text run:   response.output_item.added (message), response.content_part.added,
                    response.output_text.delta ..., then when it ends
                    response.output_text.done, response.content_part.done,
                    response.output_item.done
    per tool call:  response.output_item.added (function_call),
                    response.function_call_arguments.delta ..., then
                    response.function_call_arguments.done, response.output_item.done
    response.completed, or response.incomplete when max_output_tokens cut it short
    (a failure after the start: error, then response.failed)

The complete response (streamed or not) is what is stored, with its conversation, when
the request said `store`, and its input and output items are what its `conversation` gains
(ResponsesTurn.answered_with; both written with the settlement).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from conveyor.gateway.api.tools import ChatMessage
from conveyor.gateway.clients.detok import GenerationDelta, ToolCallDelta
from conveyor.gateway.clients.engine import PositionLogprobs
from conveyor.gateway.clients.tokenizer import PromptTokens
from conveyor.gateway.errors import APIError
from conveyor.gateway.logprob_entries import chat_logprobs
from conveyor.gateway.response_formats import ChoiceResult, OutputOptions, ResponseFormat
from conveyor.gateway.responses.conversation import ResponsesTurn
from conveyor.gateway.usage_totals import UsageTotals


@dataclass(slots=True)
class _Item:
    """An output item as it grows: a message's text (and logprob entries), or a call."""

    id: str
    output_index: int
    type: str
    text: str = ""
    logprobs: list[dict] = field(default_factory=list)
    call_id: str = ""
    name: str = ""
    arguments: str = ""

    def as_dict(self, status: str) -> dict:
        if self.type == "message":
            content = [_output_text(self.text, self.logprobs)] if status != "in_progress" else []
            return {"id": self.id, "type": "message", "status": status, "role": "assistant",
                    "content": content}
        return {"id": self.id, "type": "function_call", "status": status,
                "call_id": self.call_id, "name": self.name, "arguments": self.arguments}


def _output_text(text: str, logprobs: list[dict]) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


class ResponsesFormat(ResponseFormat):
    """The Response object and its events (see the module doc)."""

    def __init__(self, response_id: str, model: str, num_top_logprobs: int | None,
                 options: OutputOptions, prompts: list[PromptTokens], turn: ResponsesTurn):
        super().__init__(response_id, model, num_top_logprobs, options, prompts)
        self.turn = turn
        self.created = turn.created_at or self.created
        self._items: list[_Item] = []
        self._open: _Item | None = None
        self._sequence_number = turn.first_sequence_number

    stream_end = b""

    def encode(self, chunk: dict) -> bytes:
        """`event: <type>` and the event's data, numbered in the order sent."""
        self._sequence_number += 1
        return encode_event(chunk, self._sequence_number - 1)

    # -- the stream ---------------------------------------------------------------------

    def opening_chunks(self, num_choices: int) -> list[dict]:
        response = self._response("in_progress", [], None)
        return [{"type": "response.created", "response": response},
                {"type": "response.in_progress", "response": response}]

    def chunks(self, index: int, delta: GenerationDelta, texts: dict[int, str]) -> list[dict]:
        events = self._text_events(delta, texts) if delta.text else []
        for piece in delta.tool_calls:
            events += self._call_events(piece)
        return events

    def closing_chunks(self, usage: UsageTotals) -> list[dict]:
        events = self._close()
        response = self._final([item.as_dict(_status(usage)) for item in self._items],
                               usage)
        ended = "response.incomplete" if response["status"] == "incomplete" \
            else "response.completed"
        return [*events, {"type": ended, "response": response}]

    def error_chunks(self, error: APIError) -> list[dict]:
        failed = self._response("failed", [item.as_dict("incomplete") for item in self._items],
                                None)
        failed["error"] = response_error(error)
        return [{"type": "error", "code": error.code, "message": error.message,
                 "param": error.param},
                {"type": "response.failed", "response": failed}]

    def _text_events(self, delta: GenerationDelta, texts: dict[int, str]) -> list[dict]:
        events = []
        if self._open is None or self._open.type != "message":
            events += self._close()
            self._open = item = self._new_item("message")
            events += [{"type": "response.output_item.added", "output_index": item.output_index,
                        "item": item.as_dict("in_progress")},
                       {**self._at(item), "type": "response.content_part.added",
                        "part": _output_text("", [])}]
        item = self._open
        logprobs = self._logprob_entries(delta.token_ids, delta.logprobs, texts)
        item.text += delta.text
        item.logprobs += logprobs
        event = {**self._at(item), "type": "response.output_text.delta", "delta": delta.text,
                 "logprobs": logprobs}
        return [*events, self._obfuscated(event, delta.text)]

    def _call_events(self, piece: ToolCallDelta) -> list[dict]:
        if piece.id:  # a new call: its id and name
            events = self._close()
            self._open = item = self._new_item("function_call")
            item.call_id, item.name = piece.id, piece.name
            return [*events, {"type": "response.output_item.added",
                              "output_index": item.output_index,
                              "item": item.as_dict("in_progress")}]
        item = [i for i in self._items if i.type == "function_call"][piece.index]
        item.arguments += piece.arguments
        return [{"type": "response.function_call_arguments.delta", "item_id": item.id,
                 "output_index": item.output_index, "delta": piece.arguments}]

    def _close(self) -> list[dict]:
        """The events that end the open item, if any."""
        item, self._open = self._open, None
        if item is None:
            return []
        done = {"type": "response.output_item.done", "output_index": item.output_index,
                "item": item.as_dict("completed")}
        if item.type == "function_call":
            return [{"type": "response.function_call_arguments.done", "item_id": item.id,
                     "output_index": item.output_index, "name": item.name,
                     "arguments": item.arguments}, done]
        return [{**self._at(item), "type": "response.output_text.done", "text": item.text,
                 "logprobs": item.logprobs},
                {**self._at(item), "type": "response.content_part.done",
                 "part": _output_text(item.text, item.logprobs)}, done]

    @staticmethod
    def _at(item: _Item) -> dict:
        return {"item_id": item.id, "output_index": item.output_index, "content_index": 0}

    def _new_item(self, kind: str) -> _Item:
        prefix = "msg" if kind == "message" else "fc"
        item = _Item(f"{prefix}_{uuid.uuid4().hex}", len(self._items), kind)
        self._items.append(item)
        return item

    # -- the whole response -------------------------------------------------------------

    def response(self, results: list[ChoiceResult], texts: dict[int, str],
                 usage: UsageTotals) -> dict:
        [result] = results
        if result.text or not result.tool_calls:
            item = self._new_item("message")
            item.text = result.text
            item.logprobs = self._logprob_entries(result.token_ids, result.logprobs, texts)
        for call in result.tool_calls:
            item = self._new_item("function_call")
            item.call_id, item.name = call["id"], call["function"]["name"]
            item.arguments = call["function"]["arguments"]
        return self._final([item.as_dict(_status(usage)) for item in self._items], usage)

    def _final(self, output: list[dict], usage: UsageTotals) -> dict:
        """The complete response; kept for the store and the conversation
        (ResponsesTurn.answered_with)."""
        response = self._response(_status(usage), output, _usage(usage))
        if usage.finish_reason == "length":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        self.turn.answered_with(response, self._answer())
        return response

    def _answer(self) -> ChatMessage:
        """This turn's output as the assistant message a later turn reads."""
        text = "".join(item.text for item in self._items if item.type == "message")
        calls = [{"id": item.call_id, "type": "function",
                  "function": {"name": item.name, "arguments": item.arguments}}
                 for item in self._items if item.type == "function_call"]
        return ChatMessage(role="assistant", content=text or None, tool_calls=calls or None)

    def queued(self) -> dict:
        """The response of a background request as created: queued, no output yet."""
        return self._response("queued", [], None)

    def _response(self, status: str, output: list[dict], usage: dict | None) -> dict:
        request = self.turn.request
        text = request.text
        return {
            "id": self.response_id, "object": "response", "created_at": self.created,
            "status": status, "completed_at": time.time() if status == "completed" else None,
            "background": bool(request.background),
            "conversation": {"id": request.conversation_id} if request.conversation_id else None,
            "error": None, "incomplete_details": None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": request.max_tool_calls, "model": self.model, "output": output,
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "prompt_cache_key": request.prompt_cache_key,
            "reasoning": request.reasoning.model_dump() if request.reasoning else
            {"effort": None, "summary": None},
            "safety_identifier": request.safety_identifier,
            "service_tier": self.options.served_tier or "default", "store": request.store,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": {"format": text.format.model_dump(by_alias=True, exclude_none=True)
                     if text and text.format else {"type": "text"},
                     "verbosity": (text.verbosity if text else None) or "medium"},
            "tool_choice": _dumped(request.tool_choice) or "auto",
            "tools": [_dumped(tool) for tool in request.tools or ()],
            "top_logprobs": request.top_logprobs or 0,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": request.truncation or "disabled", "usage": usage, "user": request.user,
            "metadata": request.metadata or {},
        }

    def _logprob_entries(self, token_ids: list[int], logprobs: list[PositionLogprobs],
                         texts: dict[int, str]) -> list[dict]:
        if not self.wants_logprobs:
            return []
        return chat_logprobs(token_ids, logprobs, texts, self.num_top_logprobs)["content"]


def encode_event(event: dict, sequence_number: int) -> bytes:
    """One SSE event of the Responses stream: `event: <type>`, then its data, numbered."""
    event["sequence_number"] = sequence_number
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def response_error(error: APIError) -> dict:
    """A failed Response's `error`: its code (OpenAI's short list) and message."""
    if error.status == 429:
        code = "rate_limit_exceeded"
    else:
        code = "invalid_prompt" if 400 <= error.status < 500 else "server_error"
    return {"code": code, "message": error.message}


def _status(usage: UsageTotals) -> str:
    return "incomplete" if usage.finish_reason == "length" else "completed"


def _usage(usage: UsageTotals) -> dict:
    """The Responses usage; cache_write_tokens are the prompt tokens computed (not read
    from the prefix cache), which the engine caches in full blocks for later requests."""
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": usage.cached_tokens,
                "cache_write_tokens": usage.prompt_tokens - usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def _dumped(value):
    return value.model_dump(by_alias=True, exclude_none=True) if hasattr(value, "model_dump") \
        else value
