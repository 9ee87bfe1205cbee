"""A constraint on a request's output (structured outputs), as vLLM's offline API names it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from conveyor.engine.sampling_params import InvalidSamplingParams

KINDS = ("json", "json_object", "regex", "choice", "grammar")
"""The constraint kinds, as StructuredOutputsParams' field names."""


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """What the output must match: exactly one field is set (vLLM's names).

    `json`: a JSON Schema (text or dict), the output one JSON value valid against it;
    `json_object`: any JSON object; `regex`: a regular expression the whole output
    matches; `choice`: exactly one of these strings; `grammar`: a context-free grammar in
    Lark syntax, or GBNF when its rules are written with `::=`. Checked on construction
    (InvalidSamplingParams); whether the constraint compiles is the grammar library's
    verdict, given when the engine compiles it (InvalidConstraint).
    """

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        kinds = [kind for kind in KINDS if getattr(self, kind) is not None]
        if len(kinds) != 1:
            raise InvalidSamplingParams(
                f"structured output needs exactly one of {', '.join(KINDS)}, got "
                f"{', '.join(kinds) or 'none'}")
        if self.json_object is False:
            raise InvalidSamplingParams("structured output json_object must be true when set")
        if self.choice is not None:
            _check_choice(self.choice)
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))

    @property
    def kind(self) -> str:
        """The name of the one field set."""
        return next(kind for kind in KINDS if getattr(self, kind) is not None)

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what a compiled grammar is cached by. The choice is its options as
        a JSON list; json_object has no text."""
        kind = self.kind
        if kind == "choice":
            return kind, json.dumps(list(self.choice))
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


def _check_choice(options) -> None:
    if isinstance(options, str) or not options:
        raise InvalidSamplingParams("structured output choice needs a list of at least one "
                                    "option")
    bad = next((o for o in options if not isinstance(o, str) or not o), None)
    if bad is not None:
        raise InvalidSamplingParams(f"structured output choice options must be non-empty "
                                    f"strings, got {bad!r}")
