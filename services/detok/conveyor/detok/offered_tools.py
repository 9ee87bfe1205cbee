"""The functions a stream's model may call, and which of its calls count.

With tools given, a call counts only if it names one of them, and, for a strict one, its
arguments validate against the function's parameters schema (OpenAI's `strict`: the
calls returned follow the schema). A call that does not count is read as malformed
JSON is: it stays content. Without tools every well-formed call counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from conveyor.detok.errors import InvalidStreamError
from conveyor.detok.tool_call_formats import Accept, ParsedCall


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A function the model may call."""

    name: str
    parameters: dict[str, Any] | None = None
    """Its parameters' JSON Schema (None: any object)."""
    strict: bool = False


def call_acceptor(tools: tuple[ToolSpec, ...]) -> Accept:
    """Which calls count (see the module doc); InvalidStreamError for a schema that is
    not one."""
    if not tools:
        return lambda call: True
    validators = {tool.name: _validator(tool) if tool.strict else None for tool in tools}

    def accept(call: ParsedCall) -> bool:
        if call.name not in validators:
            return False
        validator = validators[call.name]
        return validator is None or validator.is_valid(json.loads(call.arguments))

    return accept


def _validator(tool: ToolSpec) -> Draft202012Validator:
    schema = tool.parameters or {"type": "object"}
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as error:
        raise InvalidStreamError(
            f"the parameters of tool {tool.name!r} are not a valid JSON Schema: "
            f"{error.message}") from None
    return Draft202012Validator(schema)
