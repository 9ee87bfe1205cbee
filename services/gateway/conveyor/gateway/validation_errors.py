"""Request validation failures as OpenAI 400s (never FastAPI's 422)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from conveyor.gateway.api.fields import INVALID, INVALID_UNICODE, UNSUPPORTED
from conveyor.gateway.errors import APIError, bad_request

_NOT_AN_OBJECT = {"model_attributes_type", "dict_type", "model_type"}


def validation_error(errors: Sequence[dict[str, Any]]) -> APIError:
    """One 400 naming the first problem and the parameter it is about."""
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return bad_request(f"malformed JSON in the request body: {_json_detail(first)}")
    if not loc and (first.get("type") in _NOT_AN_OBJECT or first.get("type") == "missing"):
        return bad_request("the request body must be a JSON object")
    if first.get("type") == INVALID_UNICODE:
        return bad_request(first.get("msg", "invalid Unicode"), first["ctx"]["param"])
    param = ".".join(_without_union_tags(loc)) or None
    if first.get("type") in (UNSUPPORTED, INVALID):
        code = UNSUPPORTED if first["type"] == UNSUPPORTED else None
        return bad_request(first["ctx"]["message"], _nested(param, first["ctx"]["param"]),
                           code)
    if first.get("type") == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param,
                           "unknown_parameter")
    message = first.get("msg", "invalid value")
    return bad_request(f"{param}: {message}" if param else message, param)


def _nested(path: str | None, param: str) -> str:
    """`param` as named: a top-level field (`audio`), or the field of the object that
    refused it (`messages.audio` at `messages.0`: `messages.0.audio`)."""
    if path is None or "." not in param:
        return param
    return f"{path}.{param.rsplit('.', 1)[-1]}"


def _json_detail(error: dict[str, Any]) -> str:
    context = error.get("ctx") or {}
    return str(context.get("error", error.get("msg", "")))


def _without_union_tags(loc: list[str]) -> list[str]:
    """Drop the union-member tags pydantic adds (`str`, `list[...]`, `function-after[...]`)."""
    return [p for p in loc if not (p in {"str", "int", "float", "bool"} or "[" in p)]
