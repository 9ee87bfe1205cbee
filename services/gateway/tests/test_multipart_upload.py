"""POST /v1/files' body parser: the file streamed into the store with its own limit."""

from __future__ import annotations

import pytest

from conveyor.common.file_store import DirectoryFileStore, FileTooLarge
from conveyor.gateway.batches.multipart_upload import receive_upload
from conveyor.gateway.errors import APIError

BOUNDARY = "xyzzy"
CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"


def form(file_bytes: bytes | None, purpose: str = "batch") -> bytes:
    parts = [f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'
             f"{purpose}\r\n".encode()]
    if file_bytes is not None:
        parts.append(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; '
                     f'filename="in.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n'.encode()
                     + file_bytes + b"\r\n")
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


async def pieces(body: bytes, size: int = 7):
    """The body as it arrives from a client: in small pieces."""
    for start in range(0, len(body), size):
        yield body[start:start + size]


async def test_the_file_is_written_piece_by_piece_and_committed(tmp_path):
    store = DirectoryFileStore(tmp_path)
    data = b'{"custom_id": "a"}\n' * 50
    upload = await receive_upload(CONTENT_TYPE, pieces(form(data)), store, "file-1", 10_000)
    assert (upload.fields, upload.filename, upload.num_bytes) == (
        {"purpose": "batch"}, "in.jsonl", len(data))
    with store.open("file-1") as file:
        assert file.read() == data


async def test_past_its_limit_the_upload_stops_and_nothing_is_kept(tmp_path):
    store = DirectoryFileStore(tmp_path)
    with pytest.raises(FileTooLarge):
        await receive_upload(CONTENT_TYPE, pieces(form(b"x" * 2000)), store, "file-1", 1000)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("content_type", "body", "param"), [
    ("application/json", b"{}", None),
    (CONTENT_TYPE, form(None), "file"),
    (CONTENT_TYPE, b"--xyzzy\r\ngarbage", None),
    (CONTENT_TYPE, form(b"cut short")[:-12], None),  # no closing boundary: not kept
])
async def test_a_bad_form_is_a_400(tmp_path, content_type, body, param):
    store = DirectoryFileStore(tmp_path)
    with pytest.raises(APIError) as error:
        await receive_upload(content_type, pieces(body), store, "file-1", 1000)
    assert error.value.status == 400 and error.value.param == param
    assert not (tmp_path / "file-1").exists()
