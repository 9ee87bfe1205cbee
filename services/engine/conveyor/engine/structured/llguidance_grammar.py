"""StructuredOutputsParams as an llguidance grammar definition (JSON text)."""

from __future__ import annotations

import json

import llguidance

from conveyor.engine.structured.errors import InvalidConstraint
from conveyor.engine.structured.structured_outputs_params import StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON as json.dumps writes it by default: one line, ", " and ": " between items, no other
whitespace. A small model given free whitespace may pad an object with newlines until
max_tokens; these separators are the ones most JSON in its training has. A schema's own
"x-guidance" options override them."""

ANY_OBJECT_SCHEMA = '{"type": "object"}'
OPEN_OBJECT_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "not", "if", "then",
                 "else", "contains", "propertyNames", "unevaluatedItems")
"""The keywords whose values are subschemas (maps of them, lists of them, or one)."""


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
    closed = json.dumps(closed_objects(json.loads(schema)))
    return llguidance.LLMatcher.grammar_from_json_schema(closed, defaults=JSON_OPTIONS)


def closed_objects(schema):
    """`schema` with every object schema that lists `properties` and says nothing of other
    keys closed to them (`additionalProperties: false`), as xgrammar's strict mode (vLLM's
    default backend) reads schemas. JSON Schema would allow any other key, and a small
    model given that freedom adds keys whose strings run to max_tokens (LangChain's
    function_calling schemas, for one, leave objects open). Only subschemas are visited
    (values such as `const`, `enum` or `default` are left as they are)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    for key in SCHEMA_VALUES:
        if key in out:
            out[key] = closed_objects(out[key])
    if isinstance(out.get("properties"), dict) and \
            not any(key in out for key in OPEN_OBJECT_KEYWORDS):
        out["additionalProperties"] = False
    return out
