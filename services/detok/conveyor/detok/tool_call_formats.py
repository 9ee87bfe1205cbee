"""Where a model's text holds tool calls: each format reads the whole text so far.

A format is a function `(text, final) -> ParsedText`. Every format keeps one promise,
which lets a stream send what it read at once and never take it back: as the text
grows (and at `final`, when it is whole), `content` only grows at its end, calls are
only added at the end, and a call's name never changes while its arguments only grow.
So a format holds back whatever it cannot yet place (a partial `<tool_call>` marker, a
block not yet closed) until the text decides it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call: the function's name and its arguments (a JSON object's text)."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedText:
    """The content (text that is not a call) and the calls, in order."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


Format = Callable[[str, bool], ParsedText]
Accept = Callable[[ParsedCall], bool]
"""Whether a well-formed call counts (its function is offered, its arguments valid); one
that does not is read as malformed: content."""


def _any_call(call: ParsedCall) -> bool:
    return True


class ToolCallFormat(Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    JSON_ARRAY = "json_array"
    NAMED = "named"


def format_reader(fmt: ToolCallFormat, function_name: str = "",
                  accept: Accept = _any_call) -> Format:
    """The reader of `fmt` (NAMED: a call of `function_name`). `accept` judges the calls of
    the free formats (HERMES, LLAMA3_JSON); the others are constrained by a grammar."""
    if fmt is ToolCallFormat.NAMED:
        return lambda text, final: read_named(function_name, text, final)
    if fmt is ToolCallFormat.JSON_ARRAY:
        return read_json_array
    read = read_hermes if fmt is ToolCallFormat.HERMES else read_llama3_json
    return lambda text, final: read(text, final, accept)


# -- hermes ------------------------------------------------------------------------------

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def read_hermes(text: str, final: bool, accept: Accept = _any_call) -> ParsedText:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among content. A
    block whose JSON is no call stays content; at the end an unclosed block counts if its
    JSON is whole (small models often stop before the closing tag)."""
    content: list[str] = []
    calls: list[ParsedCall] = []
    position = 0
    while True:
        start = text.find(HERMES_OPEN, position)
        if start < 0:
            tail = text[position:]
            content.append(tail if final else tail[:len(tail) - _partial_marker(tail)])
            break
        content.append(text[position:start])
        body_start = start + len(HERMES_OPEN)
        end = text.find(HERMES_CLOSE, body_start)
        if end < 0 and not final:
            break  # the block is still being written
        block_end = len(text) if end < 0 else end + len(HERMES_CLOSE)
        call = _call_of(text[body_start:len(text) if end < 0 else end], "arguments")
        if call is None or not accept(call):
            content.append(text[start:block_end])
        else:
            calls.append(call)
        position = block_end
        if end < 0:
            break
    return ParsedText("".join(content), calls)


def _partial_marker(text: str) -> int:
    """Length of the longest end of `text` that begins the opening marker."""
    for length in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if HERMES_OPEN.startswith(text[-length:]):
            return length
    return 0


# -- llama 3 json ------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"


def read_llama3_json(text: str, final: bool, accept: Accept = _any_call) -> ParsedText:
    """The whole text is calls (`{"name": ..., "parameters": {...}}`, `;`-separated, after
    an optional <|python_tag|>) or the whole text is content: decided by its first
    character, and for calls only once the text is whole."""
    stripped = text.lstrip()
    if not final and (not stripped or PYTHON_TAG.startswith(stripped)):
        return ParsedText()  # nothing decides it yet
    body = stripped.removeprefix(PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return ParsedText(text)
    if not final:
        return ParsedText()
    calls = _semicolon_calls(body)
    if not calls or not all(accept(call) for call in calls):
        return ParsedText(text)
    return ParsedText("", calls)


def _semicolon_calls(body: str) -> list[ParsedCall] | None:
    decoder = json.JSONDecoder()
    calls, position = [], 0
    while position < len(body):
        try:
            value, position = decoder.raw_decode(body, position)
        except (json.JSONDecodeError, RecursionError):
            return None
        call = _call_from(value, "parameters")
        if call is None:
            return None
        calls.append(call)
        position = _skip(body, position, " \t\r\n;")
    return calls


# -- json array (tool_choice "required") -------------------------------------------------

def read_json_array(text: str, final: bool) -> ParsedText:
    """A JSON array of `{"name": ..., "parameters": {...}}`: each element is a call once
    it is whole. What cannot be read as such (a cut-off last element) is content at the
    end."""
    decoder = json.JSONDecoder()
    position = _skip(text, 0, " \t\r\n")
    if position == len(text) or text[position] != "[":
        return ParsedText(text if final and position < len(text) else "")
    calls: list[ParsedCall] = []
    position += 1
    while True:
        position = _skip(text, position, " \t\r\n,")
        if position < len(text) and text[position] == "]":
            return ParsedText("", calls)
        try:
            value, end = decoder.raw_decode(text, position)
        except (json.JSONDecodeError, RecursionError):
            return ParsedText(text[position:] if final else "", calls)
        call = _call_from(value, "parameters")
        if call is None:
            return ParsedText(text[position:] if final else "", calls)
        calls.append(call)
        position = end


# -- named (a named tool_choice) ---------------------------------------------------------

def read_named(function_name: str, text: str, final: bool) -> ParsedText:
    """The whole text is the arguments of one call of `function_name`."""
    return ParsedText("", [ParsedCall(function_name, text)])


# -- shared ------------------------------------------------------------------------------

def _call_of(body: str, arguments_key: str) -> ParsedCall | None:
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    return _call_from(value, arguments_key)


def _call_from(value: object, arguments_key: str) -> ParsedCall | None:
    """A call from a decoded `{"name": str, <arguments_key> | other key: object}`; the
    arguments as compact JSON text. None when `value` is no call."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    other_key = "parameters" if arguments_key == "arguments" else "arguments"
    arguments = value.get(arguments_key, value.get(other_key, {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _skip(text: str, position: int, characters: str) -> int:
    while position < len(text) and text[position] in characters:
        position += 1
    return position
