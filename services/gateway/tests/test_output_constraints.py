"""Structured-output and tool fields: what each asks of the engine (one constraint) and
of detok (which tool calls to read), and the 400s for what cannot be served; then the
chat format's tool-call chunks and message."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from conveyor.gateway.api.schemas import ChatCompletionRequest, CompletionRequest
from conveyor.gateway.clients.detok import GenerationDelta, ToolCallDelta, ToolCallFormat
from conveyor.gateway.clients.engine import ConstraintKind
from conveyor.gateway.errors import APIError
from conveyor.gateway.output_constraints import output_plan
from conveyor.gateway.response_formats import ChatFormat, ChoiceResult

MESSAGES = [{"role": "user", "content": "hi"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time"}}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def plan_of(body):
    return output_plan(body, ToolCallFormat.HERMES)


@pytest.mark.parametrize("fields, kind, value", [
    ({"response_format": {"type": "json_object"}}, ConstraintKind.JSON_OBJECT, ""),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "w", "schema": PARAMS, "strict": True}}},
     ConstraintKind.JSON_SCHEMA, json.dumps(PARAMS)),
    ({"structured_outputs": {"json": PARAMS}}, ConstraintKind.JSON_SCHEMA, json.dumps(PARAMS)),
    ({"structured_outputs": {"regex": "[a-z]+"}}, ConstraintKind.REGEX, "[a-z]+"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, ConstraintKind.CHOICE, ("yes", "no")),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, ConstraintKind.GRAMMAR, 'start: "a"'),
    ({"structured_outputs": {"json_object": True}}, ConstraintKind.JSON_OBJECT, ""),
    ({"guided_json": json.dumps(PARAMS)}, ConstraintKind.JSON_SCHEMA, json.dumps(PARAMS)),
    ({"guided_regex": r"\d+", "guided_decoding_backend": "auto"}, ConstraintKind.REGEX, r"\d+"),
    ({"guided_choice": ["a", "b"]}, ConstraintKind.CHOICE, ("a", "b")),
    ({"guided_grammar": 'root ::= "a"'}, ConstraintKind.GRAMMAR, 'root ::= "a"'),
])
def test_each_field_becomes_one_constraint(fields, kind, value):
    for body in (chat(**fields), CompletionRequest.model_validate({"prompt": "x", **fields})):
        plan = plan_of(body)
        assert (plan.constraint.kind, plan.constraint.value) == (kind, value)
        assert plan.tool_calls is None


def test_text_format_and_no_fields_constrain_nothing():
    assert plan_of(chat(response_format={"type": "text"})).constraint is None
    assert plan_of(chat()).constraint is None


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[1]"}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(fields, param):
    with pytest.raises(APIError) as raised:
        plan_of(chat(**fields))
    assert raised.value.status == 400 and raised.value.param == param


def test_unknown_structured_outputs_options_are_refused_by_name():
    with pytest.raises(ValidationError, match="structured_outputs.whitespace_pattern"):
        chat(structured_outputs={"regex": "a", "whitespace_pattern": " "})


def test_tool_choice_auto_reads_calls_in_the_configured_format():
    auto = plan_of(chat(tools=TOOLS)).tool_calls
    assert auto.format is ToolCallFormat.HERMES
    assert [(t.name, t.parameters_json) for t in auto.tools] == [
        ("get_weather", json.dumps(PARAMS)), ("get_time", "")]
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    assert [t.strict for t in plan_of(chat(tools=strict)).tool_calls.tools] == [True]
    assert output_plan(chat(tools=TOOLS), ToolCallFormat.LLAMA3_JSON).tool_calls.format \
        is ToolCallFormat.LLAMA3_JSON
    one = plan_of(chat(tools=TOOLS, parallel_tool_calls=False))
    assert (one.constraint, one.tool_calls.max_calls) == (None, 1)
    assert plan_of(chat(tools=TOOLS, tool_choice="none")).tool_calls is None
    assert plan_of(chat(tool_choice="auto")).tool_calls is None  # no tools: nothing to call


def test_tool_choice_required_constrains_to_an_array_of_calls():
    plan = plan_of(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    schema = json.loads(plan.constraint.value)
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    weather, time = schema["items"]["anyOf"]
    assert weather["properties"] == {"name": {"type": "string", "enum": ["get_weather"]},
                                     "parameters": PARAMS}
    assert time["properties"]["parameters"] == {"type": "object"}
    assert (plan.tool_calls.format, plan.tool_calls.max_calls) == (ToolCallFormat.JSON_ARRAY, 1)


def test_a_named_tool_choice_constrains_to_its_arguments():
    plan = plan_of(chat(tools=TOOLS, tool_choice={"type": "function",
                                                  "function": {"name": "get_weather"}}))
    assert json.loads(plan.constraint.value) == PARAMS
    assert (plan.tool_calls.format, plan.tool_calls.function_name) == (ToolCallFormat.NAMED,
                                                                        "get_weather")


def test_tools_must_be_functions():
    with pytest.raises(ValidationError):
        chat(tools=[{"type": "retrieval"}])


def _delta(text="", pieces=(), finish=None) -> GenerationDelta:
    return GenerationDelta(text, [], [], finish, None, None, list(pieces))


CALL = [ToolCallDelta(0, "call_1", "get_weather"), ToolCallDelta(0, arguments='{"city": '),
        ToolCallDelta(0, arguments='"Paris"}')]


def test_streamed_tool_calls_come_as_openai_chunks_and_finish_with_tool_calls():
    fmt = ChatFormat("chatcmpl-1", "m", None)
    chunks = fmt.chunks(0, _delta("Sure.", CALL[:2]), {}) + \
        fmt.chunks(0, _delta("", CALL[2:], finish="stop"), {})
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [
        {"content": "Sure."},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "tool_calls"]


def test_a_collected_choice_carries_its_tool_calls_and_no_content():
    result = ChoiceResult()
    result.add(_delta("", CALL))
    result.add(_delta("", finish="stop"))
    choice = ChatFormat("chatcmpl-1", "m", None).choice(0, result, {})
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert choice["finish_reason"] == "tool_calls"


def test_a_cut_off_call_keeps_finish_reason_length():
    result = ChoiceResult()
    result.add(_delta("", CALL[:2], finish="length"))
    assert ChatFormat("c", "m", None).choice(0, result, {})["finish_reason"] == "length"
