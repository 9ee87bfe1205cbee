"""Chat messages as the service receives them, and their template form."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from conveyor.tokenizer.errors import InvalidRequest

ROLE_ALIASES = {"developer": "system"}
"""Roles read as another role before rendering."""
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class ContentPart:
    """One part of a message's content; only text parts exist so far."""

    type: str
    text: str = ""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat message; `parts`, when given, replace `content`."""

    role: str
    content: str = ""
    parts: tuple[ContentPart, ...] = field(default_factory=tuple)
    name: str = ""
    tool_call_id: str = ""
    tool_calls_json: str = ""

    @property
    def num_chars(self) -> int:
        """Characters of text this message carries (what a length check counts)."""
        return (len(self.role) + len(self.content) + sum(len(p.text) for p in self.parts)
                + len(self.name) + len(self.tool_call_id) + len(self.tool_calls_json))


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The conversation as chat templates read it: dicts with role and content
    (plus name, tool_call_id and tool_calls when set). Raises InvalidRequest."""
    if not messages:
        raise InvalidRequest("messages is empty; send at least one message")
    return [_template_message(index, message) for index, message in enumerate(messages)]


def _template_message(index: int, message: ChatMessage) -> dict:
    out = {"role": _role(index, message.role), "content": _content(index, message)}
    if message.name:
        out["name"] = message.name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls_json:
        out["tool_calls"] = parse_json(
            message.tool_calls_json, list, f"messages[{index}].tool_calls")
    return out


def _role(index: int, role: str) -> str:
    role = ROLE_ALIASES.get(role, role)
    if role not in ROLES:
        known = ", ".join([*ROLES, *ROLE_ALIASES])
        raise InvalidRequest(f"messages[{index}].role {role!r} is not one of {known}")
    return role


def _content(index: int, message: ChatMessage) -> str:
    if not message.parts:
        return message.content
    texts = []
    for part_index, part in enumerate(message.parts):
        where = f"messages[{index}].content[{part_index}]"
        if not part.type:
            raise InvalidRequest(f"{where} has no type; content parts need type 'text'")
        if part.type != "text":
            raise InvalidRequest(
                f"{where} has type {part.type!r}; only 'text' content parts are supported")
        texts.append(part.text)
    return "".join(texts)


def with_system_text(conversation: list[dict], text: str) -> list[dict]:
    """The template conversation with `text` after its system message's content (in a new
    system message first when it has none)."""
    if conversation and conversation[0]["role"] == "system":
        first = conversation[0]
        return [{**first, "content": f"{first['content']}\n\n{text}"}, *conversation[1:]]
    return [{"role": "system", "content": text}, *conversation]


def parse_json(text: str, expected: type, what: str):
    """Parse a JSON field of the request, which must hold an `expected` (list or dict)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest(f"{what} is nested too deeply") from None
    if not isinstance(value, expected):
        kind = "a JSON array" if expected is list else "a JSON object"
        raise InvalidRequest(f"{what} must be {kind}, got {type(value).__name__}")
    return value
