"""Responses API items, two ways: as the chat messages the model reads, and as a
conversation keeps them (the Conversations API's items).

    message (user, system, developer)   that message
    message (assistant; output_text)    an assistant message with that text
    function_call                       an assistant message's tool call (consecutive
                                        calls, or calls after its text, join one message)
    function_call_output                a tool message answering that call_id

A kept item has an id (the caller's, else a new `msg_`, `fc_` or `fco_` one), a status
(`completed` unless given) and, for a message, its content as typed parts (a string is one
`input_text` part, or `output_text` for an assistant); a function output keeps its text. It
reads back as the input item it was.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from pydantic import TypeAdapter

from conveyor.gateway.api.tools import ChatMessage
from conveyor.gateway.responses.request_body import (
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    InputText,
    MessageItem,
    OutputText,
)

_ITEMS = TypeAdapter(list[InputItem])

_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def chat_messages(items: str | list[InputItem]) -> list[ChatMessage]:
    """The chat messages of `items` (a string: one user message), in order."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    messages: list[ChatMessage] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=item.text))
        elif isinstance(item, FunctionCallItem):
            _add_call(messages, item)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content=item.text))
    return messages


def _add_call(messages: list[ChatMessage], item: FunctionCallItem) -> None:
    """The call joins the assistant message before it, or starts one."""
    call = {"id": item.call_id, "type": "function",
            "function": {"name": item.name, "arguments": item.arguments}}
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        last.tool_calls = [*(last.tool_calls or []), call]
    else:
        messages.append(ChatMessage(role="assistant", tool_calls=[call]))


def kept_items(items: str | list[InputItem]) -> list[dict]:
    """`items` as a conversation keeps them (see the module doc)."""
    if isinstance(items, str):
        items = [MessageItem(role="user", content=items)]
    return [_kept(item) for item in items]


def kept_output(output: list[dict]) -> list[dict]:
    """A response's output items as a conversation keeps them: without logprobs (OpenAI
    lists them only when asked to include them, which is not served)."""
    return [{**item, "content": [{k: v for k, v in part.items() if k != "logprobs"}
                                 for part in item["content"]]}
            if item["type"] == "message" else item for item in output]


def _kept(item: InputItem) -> dict:
    kept = item.model_dump(exclude_none=True, by_alias=True)
    kept["type"] = item.type
    kept.setdefault("id", f"{_ID_PREFIXES[item.type]}_{uuid.uuid4().hex}")
    kept.setdefault("status", "completed")
    if isinstance(item, MessageItem):
        parts = [item.content] if isinstance(item.content, str) else item.content
        kept["content"] = [_kept_part(part, item.role) for part in parts]
    elif isinstance(item, FunctionCallOutputItem):
        kept["output"] = item.text  # its parts' text (the SDK's output parts are input ones)
    return kept


def _kept_part(part: str | ContentPart, role: str) -> dict:
    """A message's part in the SDK's shape: a string is one text part (output_text for an
    assistant's); no logprobs and no cache breakpoint (which have no effect here)."""
    if isinstance(part, str):
        part = (OutputText(type="output_text", text=part) if role == "assistant"
                else InputText(type="input_text", text=part))
    if isinstance(part, OutputText):
        return {"type": "output_text", "text": part.text, "annotations": part.annotations or []}
    if isinstance(part, InputText):
        return {"type": "input_text", "text": part.text}
    return part.model_dump()


def repeated_id(items: list[dict], taken: Iterable[str] = ()) -> str | None:
    """The first id among `items` already `taken` or repeated; None when each is new."""
    seen = set(taken)
    for item in items:
        if item["id"] in seen:
            return item["id"]
        seen.add(item["id"])
    return None


def read_back(kept: list[dict]) -> list[InputItem]:
    """Kept items as the input items they were."""
    return _ITEMS.validate_python(kept)
