"""Tool calls read out of a stream's text as it grows, sent as deltas.

`ToolCallStream.push(text, final)` reads the whole text so far with the stream's format
(tool_call_formats.py) and returns what is new since the last push: a content delta
and tool-call deltas (a call's first delta carries its id and name, the later ones
fragments of its arguments). Content whitespace is held back until later text shows it
is not the end: whitespace around tool calls is dropped, elsewhere it is kept.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from conveyor.detok.offered_tools import ToolSpec, call_acceptor
from conveyor.detok.tool_call_formats import ToolCallFormat, format_reader


@dataclass(frozen=True, slots=True)
class ToolCallOptions:
    """How a stream's text carries tool calls."""

    format: ToolCallFormat
    function_name: str = ""
    """The function a NAMED stream calls."""
    max_calls: int = 0
    """Most calls kept (0: no limit); later ones are dropped."""
    tools: tuple[ToolSpec, ...] = ()
    """The functions offered (offered_tools.py); empty: any call counts."""


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of call `index`: its id and name (first piece) or an arguments fragment."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


def call_id(request_id: str, index: int) -> str:
    """A call's id: the same for the same request and index (a rebuilt stream agrees)."""
    digest = hashlib.sha256(f"{request_id}/{index}".encode()).hexdigest()
    return f"call_{digest[:24]}"


class ToolCallStream:
    """Content and tool-call deltas of one stream's text."""

    def __init__(self, options: ToolCallOptions, request_id: str):
        self._read = format_reader(options.format, options.function_name,
                                   call_acceptor(options.tools))
        self._max_calls = options.max_calls or None
        self._request_id = request_id
        self._text = ""
        self._num_content_out = 0
        self._num_arguments_out: list[int] = []
        """Per call sent so far: how much of its arguments went out."""

    def push(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """Add text (`final`: the text is whole); return the new content and call deltas."""
        self._text += text
        parsed = self._read(self._text, final)
        calls = parsed.calls[:self._max_calls]
        content = parsed.content if final and not calls else parsed.content.rstrip()
        content_delta = content[self._num_content_out:]
        self._num_content_out = max(self._num_content_out, len(content))
        return content_delta, self._call_deltas(calls)

    def _call_deltas(self, calls) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        for index, call in enumerate(calls):
            if index == len(self._num_arguments_out):
                deltas.append(ToolCallDelta(index, call_id(self._request_id, index), call.name))
                self._num_arguments_out.append(0)
            fragment = call.arguments[self._num_arguments_out[index]:]
            if fragment:
                deltas.append(ToolCallDelta(index, arguments=fragment))
                self._num_arguments_out[index] = len(call.arguments)
        return deltas
