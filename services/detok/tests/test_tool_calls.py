"""Tool-call formats and their streaming: each format on outputs in the form it claims,
whole, split at every character, and split at every token of the real tokenizer."""

from __future__ import annotations

import json

import pytest

from conveyor.detok.errors import InvalidStreamError
from conveyor.detok.offered_tools import ToolSpec
from conveyor.detok.stream import DetokenizeStream, StreamStart
from conveyor.detok.tool_call_formats import ParsedCall, ToolCallFormat, format_reader
from conveyor.detok.tool_call_stream import ToolCallOptions, ToolCallStream, call_id

WEATHER = {"city": "Paris", "unit": "celsius"}
HERMES_ONE = ('<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')
HERMES_TWO = (HERMES_ONE + "\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": "
              "{\"zone\": \"CET\"}}\n</tool_call>")


def _whole(fmt: ToolCallFormat, text: str, name: str = ""):
    parsed = format_reader(fmt, name)(text, True)
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@pytest.mark.parametrize("fmt, text, content, calls", [
    (ToolCallFormat.HERMES, HERMES_ONE, "", [("get_weather", WEATHER)]),
    (ToolCallFormat.HERMES, "Let me check.\n" + HERMES_TWO, "Let me check.\n\n",
     [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    (ToolCallFormat.HERMES, "no calls here, just <b>text</b>", "no calls here, just <b>text</b>",
     []),
    # the closing tag is missing but the JSON is whole: still a call
    (ToolCallFormat.HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1}}', "",
     [("f", {"a": 1})]),
    # arguments given as a JSON string are read as the object they hold
    (ToolCallFormat.HERMES, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
     "", [("f", {"a": 1})]),
    (ToolCallFormat.LLAMA3_JSON, '{"name": "get_weather", "parameters": '
     '{"city": "Paris", "unit": "celsius"}}', "", [("get_weather", WEATHER)]),
    (ToolCallFormat.LLAMA3_JSON, '<|python_tag|>{"name": "a", "parameters": {}}; '
     '{"name": "b", "parameters": {"x": [1, 2]}}', "", [("a", {}), ("b", {"x": [1, 2]})]),
    (ToolCallFormat.LLAMA3_JSON, "The weather is fine.", "The weather is fine.", []),
    (ToolCallFormat.JSON_ARRAY, '[{"name": "get_weather", "parameters": '
     '{"city": "Paris", "unit": "celsius"}}, {"name": "f", "parameters": {}}]', "",
     [("get_weather", WEATHER), ("f", {})]),
    (ToolCallFormat.NAMED, '{"city": "Paris", "unit": "celsius"}', "",
     [("get_weather", WEATHER)]),
])
def test_each_format_reads_whole_outputs(fmt, text, content, calls):
    name = "get_weather" if fmt is ToolCallFormat.NAMED else ""
    assert _whole(fmt, text, name) == (content, calls)


@pytest.mark.parametrize("fmt, text", [
    (ToolCallFormat.HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>'),
    (ToolCallFormat.HERMES, '<tool_call>{"arguments": {"a": 1}}</tool_call>'),  # no name
    (ToolCallFormat.HERMES, '<tool_call>{"name": "f", "arguments": {"a": '),  # cut off
    (ToolCallFormat.LLAMA3_JSON, '{"name": "f", "parameters": {"a": 1}; oops'),
    (ToolCallFormat.LLAMA3_JSON, '{"not": "a call"}'),
])
def test_malformed_calls_are_left_as_content(fmt, text):
    assert _whole(fmt, text) == (text, [])


def test_a_cut_off_array_element_is_content_after_the_whole_calls():
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "param'
    content, calls = _whole(ToolCallFormat.JSON_ARRAY, text)
    assert calls == [("f", {"a": 1})]
    assert content == '{"name": "g", "param'


def _streamed(options: ToolCallOptions, pieces: list[str], request_id: str = "req-1"):
    """(content, calls as {index: [id, name, arguments]}) from pushing `pieces` one by one."""
    stream = ToolCallStream(options, request_id)
    content, calls = "", {}
    for number, piece in enumerate(pieces):
        delta, deltas = stream.push(piece, final=number == len(pieces) - 1)
        content += delta
        for d in deltas:
            if d.id:
                assert d.index == len(calls) and d.name and not d.arguments  # header first
                calls[d.index] = [d.id, d.name, ""]
            else:
                assert d.index in calls and not d.name
                calls[d.index][2] += d.arguments
    return content, calls


CASES = [
    (ToolCallFormat.HERMES, "Let me check.\n" + HERMES_TWO + "\nDone."),
    (ToolCallFormat.HERMES, "Plain text, no calls at all.\n"),
    (ToolCallFormat.HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call> after'),
    (ToolCallFormat.LLAMA3_JSON, '{"name": "a", "parameters": {}}; {"name": "b", '
     '"parameters": {"x": 1}}'),
    (ToolCallFormat.LLAMA3_JSON, "  Just words."),
    (ToolCallFormat.JSON_ARRAY, '[{"name": "a", "parameters": {"q": "x, y]"}}, '
     '{"name": "b", "parameters": {}}]'),
    (ToolCallFormat.NAMED, '{"city": "Paris", "unit": "celsius"}'),
]


@pytest.mark.parametrize("fmt, text", CASES)
def test_streaming_split_at_every_character_equals_the_whole_text(fmt, text):
    options = ToolCallOptions(fmt, "get_weather" if fmt is ToolCallFormat.NAMED else "")
    whole = _streamed(options, [text])
    assert _streamed(options, [*text, ""]) == whole
    for cut in range(len(text) + 1):
        assert _streamed(options, [text[:cut], text[cut:]]) == whole


@pytest.mark.parametrize("fmt, text", CASES)
def test_streaming_split_at_every_token_equals_the_whole_text(tokenizer, fmt, text):
    options = ToolCallOptions(fmt, "get_weather" if fmt is ToolCallFormat.NAMED else "")
    stream = DetokenizeStream(tokenizer, StreamStart(request_id="req-1", tool_calls=options))
    outputs = [stream.feed([token]) for token in tokenizer.encode(text)]
    outputs.append(stream.finish())
    content = "".join(o.text for o in outputs)
    calls = {}
    for delta in (d for o in outputs for d in o.tool_calls):
        if delta.id:
            calls[delta.index] = [delta.id, delta.name, ""]
        calls[delta.index][2] += delta.arguments
    assert (content, calls) == _streamed(options, [text])


def test_streamed_calls_have_ids_from_the_request_and_compact_arguments():
    content, calls = _streamed(ToolCallOptions(ToolCallFormat.HERMES), [HERMES_TWO], "chat-7")
    assert content == ""
    assert calls == {
        0: [call_id("chat-7", 0), "get_weather", '{"city": "Paris", "unit": "celsius"}'],
        1: [call_id("chat-7", 1), "get_time", '{"zone": "CET"}'],
    }
    assert call_id("chat-7", 0) != call_id("chat-8", 0)


def test_content_is_never_taken_back_while_a_marker_may_be_starting():
    stream = ToolCallStream(ToolCallOptions(ToolCallFormat.HERMES), "r")
    assert stream.push("Hi <tool") == ("Hi", [])  # the space and the marker's start wait
    assert stream.push("box>") == (" <toolbox>", [])


def test_max_calls_keeps_the_first_calls():
    content, calls = _streamed(ToolCallOptions(ToolCallFormat.HERMES, max_calls=1),
                               [HERMES_TWO])
    assert [c[1] for c in calls.values()] == ["get_weather"]


def test_named_call_streams_its_arguments_as_they_come():
    stream = ToolCallStream(ToolCallOptions(ToolCallFormat.NAMED, "f"), "r")
    content, deltas = stream.push('{"a": ')
    assert content == "" and [d.name for d in deltas] == ["f", ""]
    assert deltas[1].arguments == '{"a": '
    assert [d.arguments for d in stream.push("1}", final=True)[1]] == ["1}"]


def test_stop_string_ends_the_text_for_the_reader(tokenizer):
    options = ToolCallOptions(ToolCallFormat.HERMES)
    stream = DetokenizeStream(tokenizer, StreamStart(stops=["</tool_call>"], tool_calls=options))
    output = stream.feed(tokenizer.encode(HERMES_ONE))
    assert output.stop_match is not None
    # the closing tag was cut by the stop string: the whole JSON is still a call
    assert [d.name for d in output.tool_calls if d.id] == ["get_weather"]


def test_parsed_call_arguments_are_compact_json():
    parsed = format_reader(ToolCallFormat.HERMES)(
        '<tool_call>{"name":"f","arguments":{"a":  [1,2]}}</tool_call>', True)
    assert parsed.calls == [ParsedCall("f", '{"a": [1, 2]}')]


STRICT_WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}, True)


@pytest.mark.parametrize("tools, text, is_call", [
    ((STRICT_WEATHER,), '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
     '</tool_call>', True),
    ((STRICT_WEATHER,), '<tool_call>{"name": "get_weather", "arguments": {"town": "Oslo"}}'
     '</tool_call>', False),  # strict: the arguments must validate
    ((ToolSpec("get_weather", STRICT_WEATHER.parameters),),
     '<tool_call>{"name": "get_weather", "arguments": {"town": "Oslo"}}</tool_call>', True),
    ((STRICT_WEATHER,), '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',
     False),  # not offered
    ((), '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>', True),
])
def test_only_calls_of_offered_tools_count_and_strict_ones_must_validate(tools, text, is_call):
    content, calls = _streamed(ToolCallOptions(ToolCallFormat.HERMES, tools=tools), [text])
    assert (bool(calls), content == text) == (is_call, not is_call)


def test_a_tool_whose_parameters_are_no_schema_is_refused(tokenizer):
    options = ToolCallOptions(ToolCallFormat.HERMES, tools=(
        ToolSpec("f", {"type": "nonsense"}, strict=True),))
    with pytest.raises(InvalidStreamError, match="parameters of tool 'f' are not a valid"):
        DetokenizeStream(tokenizer, StreamStart(tool_calls=options))
