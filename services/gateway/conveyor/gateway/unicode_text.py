"""Lone surrogates in a parsed JSON body: JSON may escape them ("\\ud800"), UTF-8 cannot
carry them, so no string holding one can be tokenized or sent over gRPC."""

from __future__ import annotations

import re
from typing import Any

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
