"""Validation of input files: the errors OpenAI reports, and chunks that start mid-file."""

from __future__ import annotations

import io
import json

from conveyor.batch.input_lines import read_lines, validate_input

URL = "/v1/chat/completions"


def line(custom_id: str, url: str = URL, **body) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": "m", "messages": [], **body}}).encode() + b"\n"


def test_each_bad_line_is_reported_with_its_number():
    raw = b"".join([line("a"), b"[1, 2\n", line("a"), line("b", url="/v1/completions"),
                    line("c", stream=True), b'{"custom_id": "d", "method": "GET", "url": "x", '
                    b'"body": {"k": 1}}\n', b'{"custom_id": "e"}\n'])
    result = validate_input(io.BytesIO(raw), URL, chunk_size=10)
    assert [(e.code, e.line, e.param) for e in result.errors] == [
        ("invalid_json_line", 2, None), ("duplicate_custom_id", 3, "custom_id"),
        ("mismatched_endpoint", 4, "url"), ("invalid_request", 5, "body.stream"),
        ("invalid_method", 6, "method"), ("missing_required_parameter", 7, "method")]
    assert result.errors[0].to_openai()["line"] == 2


def test_a_background_response_line_is_refused():
    raw = line("a", url="/v1/responses", background=True)
    result = validate_input(io.BytesIO(raw), "/v1/responses", chunk_size=10)
    assert [(e.code, e.line, e.param) for e in result.errors] == [
        ("invalid_request", 1, "body.background")]


def test_an_empty_file_is_an_error():
    result = validate_input(io.BytesIO(b"\n\n"), URL, chunk_size=10)
    assert [e.code for e in result.errors] == ["empty_file"]


def test_chunks_start_every_chunk_size_lines_and_read_from_their_offset():
    lines = [line(f"id-{i}") for i in range(7)]
    raw = lines[0] + b"\n" + b"".join(lines[1:])  # a blank line does not count
    result = validate_input(io.BytesIO(raw), URL, chunk_size=3)
    assert not result.errors and result.total == 7
    assert [first for first, _ in result.chunk_starts] == [0, 3, 6]
    first, offset = result.chunk_starts[1]
    chunk = list(read_lines(io.BytesIO(raw), offset, first, 6))
    assert [(c.index, c.custom_id) for c in chunk] == [(3, "id-3"), (4, "id-4"), (5, "id-5")]
    assert raw[chunk[1].offset:].startswith(lines[4])
