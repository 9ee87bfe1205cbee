"""What every request body is built from: unknown fields refused, types strict (`"stream":
"yes"` or `"max_tokens": "5"` is a 400, not coerced; an integer is still a valid float),
numbers finite, integers bounded by the protobuf field they travel in (so the bounds show
in /openapi.json), and a string holding a lone surrogate (JSON may escape one, UTF-8
cannot carry it) refused; the errors of a field this server refuses (`unsupported`) or
finds wrong (`invalid`)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from conveyor.common.sampling_fields import UINT32_MAX

_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_path(value: Any) -> str | None:
    """The dotted path (`messages.0.content`) of a string, or dict key, holding a
    lone surrogate; None when there is none. Iterative, so deep nesting cannot overflow."""
    pending: list[tuple[str, Any]] = [("", value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and _SURROGATE.search(key):
                    return _join(path, key.encode("utf-8", "backslashreplace").decode())
                child_path = _join(path, str(key))
                pending.append((child_path, child))
        elif isinstance(item, list):
            pending.extend((_join(path, str(i)), child) for i, child in enumerate(item))
    return None


def _join(path: str, part: str) -> str:
    return f"{path}.{part}" if path else part


INVALID_UNICODE = "invalid_unicode"
"""Error type of a lone surrogate; its context's `param` names the field."""


TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]


TokenCount = Annotated[int, Field(ge=1, le=UINT32_MAX)]


class BodyPart(BaseModel):
    """An object of a request body: unknown fields refused, types strict, numbers finite."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


UNSUPPORTED = "unsupported_parameter"
"""Error type of a field set to what this server cannot honour; its context's `param`
names the field and `message` says why."""


INVALID = "invalid_parameter"
"""Error type of a field whose value is wrong given the others (context as UNSUPPORTED's)."""


def refuse_set_fields(body: BaseModel, refused: dict[str, str]) -> None:
    """Raise `unsupported` for the first field of `refused` (name -> why) that is set."""
    for name, why in refused.items():
        if getattr(body, name) is not None:
            raise unsupported(name, why)


def invalid(param: str, message: str) -> PydanticCustomError:
    """The validation error of a field (`param`) that is wrong, saying why."""
    return PydanticCustomError(INVALID, "{message}", {"param": param, "message": message})


def unsupported(param: str, why: str, what: str | None = None) -> PydanticCustomError:
    """The validation error of a field this server refuses, saying why: `param` names it
    (`messages.audio`: the field `audio` of the message at the error's location), `what`
    is what the message calls it (default: `param`)."""
    return PydanticCustomError(UNSUPPORTED, "{message}", {
        "param": param, "message": f"{what or param} is not supported: {why}"})


class RequestBody(BodyPart):
    """A whole request body: strings are checked for lone surrogates once, at the top."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        path = lone_surrogate_path(data)
        if path is not None:
            raise PydanticCustomError(
                INVALID_UNICODE, "{param}: the string holds a lone surrogate (invalid Unicode)",
                {"param": path})
        return data


class StreamOptions(BodyPart):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: every chunk carries the usage so far (its choice's completion tokens)."""
    include_obfuscation: bool = False
    """OpenAI's: content chunks carry an `obfuscation` field of random characters that
    evens out their sizes (off unless asked for, where OpenAI's default is on)."""
