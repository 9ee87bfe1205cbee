"""A batch's input file: one request per line, `{custom_id, method, url, body}`.

`validate_input` reads the whole file once, before any line runs, and reports
what OpenAI reports in a failed batch's `errors.data` (code, message, param and
the 1-based line number). Blank lines are skipped; a line's index is its place
among the others, which is also its place in the output files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

MAX_LINES = 50_000
"""OpenAI's limit of requests per batch."""
MAX_ERRORS = 100
"""Validation errors reported at most (the rest are not listed)."""


@dataclass(slots=True, frozen=True)
class InputLine:
    index: int
    """Place among the file's non-blank lines (0-based): the output order."""
    offset: int
    """Byte offset of the line in the file (where a chunk starts reading)."""
    custom_id: str
    url: str
    body: dict


@dataclass(slots=True, frozen=True)
class LineError:
    """One reason the input was refused, as in OpenAI's `errors.data[]`."""

    code: str
    message: str
    line: int | None = None
    """1-based line number in the file."""
    param: str | None = None

    def to_openai(self) -> dict:
        return {"code": self.code, "message": self.message, "param": self.param,
                "line": self.line}


@dataclass(slots=True)
class ValidatedInput:
    """The result of reading a whole input file."""

    total: int = 0
    chunk_starts: list[tuple[int, int]] = field(default_factory=list)
    """(first line index, byte offset) of each chunk."""
    errors: list[LineError] = field(default_factory=list)


def validate_input(file: BinaryIO, endpoint: str, chunk_size: int) -> ValidatedInput:
    """Every line checked; chunk starts every `chunk_size` valid lines."""
    result = ValidatedInput()
    seen: set[str] = set()
    for number, offset, raw in _raw_lines(file):
        if len(result.errors) >= MAX_ERRORS:
            break
        line = parse_line(raw, result.total, offset, number)
        problem = line if isinstance(line, LineError) else _check(line, endpoint, seen, number)
        if problem is not None:
            result.errors.append(problem)
            continue
        if result.total % chunk_size == 0:
            result.chunk_starts.append((result.total, offset))
        result.total += 1
    _check_size(result)
    return result


def read_lines(file: BinaryIO, offset: int, first: int, end: int) -> Iterator[InputLine]:
    """Lines [first, end) of an already validated file, reading from `offset`."""
    file.seek(offset)
    index = first
    for _, line_offset, raw in _raw_lines(file, start_offset=offset):
        if index >= end:
            return
        line = parse_line(raw, index, line_offset, 0)
        if isinstance(line, LineError):
            raise ValueError(f"line {index} of a validated input no longer parses")
        yield line
        index += 1


def parse_line(raw: bytes, index: int, offset: int, number: int) -> InputLine | LineError:
    """One line as an InputLine, or why it is not one."""
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return LineError("invalid_json_line", f"This line is not valid JSON: {exc}", number)
    if not isinstance(value, dict):
        return LineError("invalid_json_line", "Each line must be a JSON object.", number)
    for name, kind in (("custom_id", str), ("method", str), ("url", str), ("body", dict)):
        if not isinstance(value.get(name), kind) or value.get(name) in ("", {}):
            return LineError("missing_required_parameter",
                             f"Each line needs `{name}` ({kind.__name__}).", number, name)
    if value["method"].upper() != "POST":
        return LineError("invalid_method", "Only POST is supported.", number, "method")
    return InputLine(index, offset, value["custom_id"], value["url"], value["body"])


def _check(line: InputLine, endpoint: str, seen: set[str], number: int) -> LineError | None:
    if line.url != endpoint:
        return LineError("mismatched_endpoint", f"The line's url {line.url!r} is not the "
                         f"batch's endpoint {endpoint!r}; every line must use it.", number, "url")
    if line.body.get("stream"):
        return LineError("invalid_request", "Streaming is not supported in a batch "
                         "(`stream` must be false or absent).", number, "body.stream")
    if line.body.get("background"):
        return LineError("invalid_request", "Background responses are not run in a batch "
                         "(`background` must be false or absent).", number, "body.background")
    if line.custom_id in seen:
        return LineError("duplicate_custom_id", f"The custom_id {line.custom_id!r} is used "
                         "by an earlier line; each must be unique.", number, "custom_id")
    seen.add(line.custom_id)
    return None


def _check_size(result: ValidatedInput) -> None:
    if not result.errors and result.total == 0:
        result.errors.append(LineError("empty_file", "The input file has no requests."))
    if result.total > MAX_LINES:
        result.errors.append(LineError("too_many_requests", f"A batch may hold at most "
                                       f"{MAX_LINES} requests, this file has {result.total}."))


def _raw_lines(file: BinaryIO, start_offset: int = 0) -> Iterator[tuple[int, int, bytes]]:
    """(1-based line number, byte offset, content) of each non-blank line."""
    offset = start_offset
    for number, raw in enumerate(file, start=1):
        if raw.strip():
            yield number, offset, raw
        offset += len(raw)
