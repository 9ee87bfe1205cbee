"""StructuredOutputsParams as an llguidance grammar definition (JSON text)."""

from __future__ import annotations

import llguidance

from conveyor.engine.structured.errors import InvalidConstraint
from conveyor.engine.structured.structured_outputs_params import StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON as json.dumps writes it by default: one line, ", " and ": " between items, no other
whitespace. A small model given free whitespace may pad an object with newlines until
max_tokens; these separators are the ones most JSON in its training has. A schema's own
"x-guidance" options override them."""

ANY_OBJECT_SCHEMA = '{"type": "object"}'


def llguidance_grammar(params: StructuredOutputsParams) -> str:
    """The grammar llguidance.LLMatcher compiles; InvalidConstraint when the text is not
    JSON (a schema) or a GBNF grammar does not convert (other errors show when the matcher
    is built)."""
    kind, text = params.key
    try:
        if kind == "json_object":
            return _json_schema(ANY_OBJECT_SCHEMA)
        if kind == "json":
            return _json_schema(text)
        return llguidance.grammar_from(kind, text)
    except ValueError as exc:
        raise InvalidConstraint(f"structured output {kind} does not compile: {exc}") from exc


def _json_schema(schema: str) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
