"""What a request's structured-output and tool fields ask of the engine and of detok.

At most one constraint per request (the engine enforces it while sampling), from
whichever field carries it:

    response_format       {"type": "json_object"} / {"type": "json_schema", ...} (OpenAI)
    structured_outputs    {json | regex | choice | grammar | json_object} (vLLM)
    guided_json, guided_regex, guided_choice, guided_grammar (vLLM's older names)
    tool_choice           "required": a JSON array of calls of the tools; a named
                          function: that function's arguments (both from the tools'
                          `parameters` schemas)

Two at once is a 400 naming the second. Tool calls are read back out of the text by
detok: for tool_choice "auto" (the default with tools) in the model family's format
(the gateway's tool_call_parser setting), where only calls of the offered functions
count and a strict function's calls must validate against its parameters (else they
stay content); for "required" as that JSON array, for a named function as its
arguments (both enforced by the constraint); "none", or no tools, reads none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from conveyor.gateway.api.mapping import GenerationBody
from conveyor.gateway.api.schemas import ChatCompletionRequest
from conveyor.gateway.api.tools import JsonObjectFormat, JsonSchemaFormat, NamedToolChoice
from conveyor.gateway.clients.detok import OfferedTool, ToolCallFormat, ToolCallParsing
from conveyor.gateway.clients.engine import Constraint, ConstraintKind
from conveyor.gateway.errors import bad_request

GRAMMAR_BACKENDS = ("auto", "guidance")
"""Values of guided_decoding_backend the engine honours (it has one grammar library)."""
ANY_OBJECT_SCHEMA = {"type": "object"}


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """The engine's constraint and detok's tool-call reading for one request."""

    constraint: Constraint | None = None
    tool_calls: ToolCallParsing | None = None


def output_plan(body: GenerationBody, auto_format: ToolCallFormat) -> OutputPlan:
    """The plan of a validated body (400 for what no plan can serve); `auto_format` is
    the format tool_choice "auto" reads calls in."""
    constraints = _field_constraints(body)
    tool_plan = _tool_plan(body, auto_format) if isinstance(body, ChatCompletionRequest) \
        else OutputPlan()
    if tool_plan.constraint is not None:
        constraints.append(("tool_choice", tool_plan.constraint))
    if len(constraints) > 1:
        (first, _), (second, _) = constraints[:2]
        raise bad_request(f"{second} cannot constrain the output together with {first}; "
                          "send one of them", second)
    return OutputPlan(constraints[0][1] if constraints else None, tool_plan.tool_calls)


# -- constraint fields -------------------------------------------------------------------

def _field_constraints(body: GenerationBody) -> list[tuple[str, Constraint]]:
    """(param, constraint) of each field that constrains the output."""
    _check_guided_options(body)
    found: list[tuple[str, Constraint]] = []
    if isinstance(body.response_format, JsonObjectFormat):
        found.append(("response_format", Constraint(ConstraintKind.JSON_OBJECT)))
    elif isinstance(body.response_format, JsonSchemaFormat):
        schema = body.response_format.json_schema.schema_
        if schema is None:
            raise bad_request("response_format.json_schema.schema is required",
                              "response_format.json_schema.schema")
        found.append(("response_format", _schema(schema, "response_format")))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(body)))
    for name, kind in (("guided_json", ConstraintKind.JSON_SCHEMA),
                       ("guided_regex", ConstraintKind.REGEX),
                       ("guided_choice", ConstraintKind.CHOICE),
                       ("guided_grammar", ConstraintKind.GRAMMAR)):
        value = getattr(body, name)
        if value is not None:
            found.append((name, _constraint(kind, value, name)))
    return found


def _structured_outputs(body: GenerationBody) -> Constraint:
    params = body.structured_outputs
    kinds = [(name, kind, value) for name, kind, value in (
        ("json", ConstraintKind.JSON_SCHEMA, params.json_),
        ("regex", ConstraintKind.REGEX, params.regex),
        ("choice", ConstraintKind.CHOICE, params.choice),
        ("grammar", ConstraintKind.GRAMMAR, params.grammar),
        ("json_object", ConstraintKind.JSON_OBJECT, params.json_object or None),
    ) if value is not None]
    if len(kinds) != 1:
        raise bad_request("structured_outputs must set exactly one of json, regex, choice, "
                          f"grammar and json_object (got {len(kinds)})", "structured_outputs")
    name, kind, value = kinds[0]
    return _constraint(kind, value, f"structured_outputs.{name}")


def _constraint(kind: ConstraintKind, value: Any, param: str) -> Constraint:
    if kind is ConstraintKind.JSON_SCHEMA:
        return _schema(value, param)
    if kind is ConstraintKind.JSON_OBJECT:
        return Constraint(kind)
    if kind is ConstraintKind.CHOICE:
        if not value or not all(value):
            raise bad_request(f"{param} must list at least one option, none empty", param)
        return Constraint(kind, tuple(value))
    if not value:
        raise bad_request(f"{param} must not be empty", param)
    return Constraint(kind, value)


def _schema(schema: dict | str, param: str) -> Constraint:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise bad_request(f"{param} is not valid JSON: {error}", param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON schema (an object)", param)
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))


def _check_guided_options(body: GenerationBody) -> None:
    backend = body.guided_decoding_backend
    if backend is not None and backend not in GRAMMAR_BACKENDS:
        raise bad_request(f"guided_decoding_backend {backend!r} is not available; this server "
                          f"uses one of {', '.join(GRAMMAR_BACKENDS)}", "guided_decoding_backend")
    if body.guided_whitespace_pattern is not None:
        raise bad_request("guided_whitespace_pattern is not supported",
                          "guided_whitespace_pattern")


# -- tools -------------------------------------------------------------------------------

def _tool_plan(body: ChatCompletionRequest, auto_format: ToolCallFormat) -> OutputPlan:
    tools = {tool.function.name: tool.function for tool in body.tools or []}
    choice = body.tool_choice or ("auto" if tools else "none")
    max_calls = 0 if body.parallel_tool_calls else 1
    if choice in ("none", "auto"):
        if not tools or choice == "none":
            return OutputPlan()
        offered = tuple(OfferedTool(name, json.dumps(f.parameters) if f.parameters else "",
                                    bool(f.strict)) for name, f in tools.items())
        return OutputPlan(None, ToolCallParsing(auto_format, max_calls=max_calls,
                                                tools=offered))
    if not tools:
        raise bad_request("tool_choice needs tools: none were given", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in tools:
            raise bad_request(f"tool_choice names the function {name!r}, which is not among "
                              "the tools", "tool_choice")
        return OutputPlan(_schema(_parameters(tools[name]), "tools"),
                          ToolCallParsing(ToolCallFormat.NAMED, name))
    return OutputPlan(_schema(_calls_schema(tools, max_calls), "tools"),
                      ToolCallParsing(ToolCallFormat.JSON_ARRAY, max_calls=max_calls))


def _calls_schema(tools: dict, max_calls: int) -> dict:
    """A JSON array of at least one call `{"name": ..., "parameters": {...}}` of the tools."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]},
                             "parameters": _parameters(function)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, function in tools.items()]
    schema = {"type": "array", "minItems": 1,
              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if max_calls:
        schema["maxItems"] = max_calls
    return schema


def _parameters(function) -> dict:
    return function.parameters or ANY_OBJECT_SCHEMA
