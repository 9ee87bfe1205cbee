"""POST /v1/files' multipart body, streamed into the file store as it arrives.

The file part goes to disk chunk by chunk, never whole into memory, and stops at
the upload limit (FileTooLarge): an upload has its own limit, not the JSON
endpoints' body limit. Other fields (`purpose`) are small and kept in memory.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from python_multipart import MultipartParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartState, parse_options_header

from conveyor.common.file_store import FileStore, FileTooLarge, FileWriter
from conveyor.gateway.errors import bad_request

_MAX_FIELD_BYTES = 64 * 1024
_MAX_DRAIN_BYTES = 1024 * 1024
"""After a refusal, how much more of the body is read (and dropped) so the client, still
sending, reads the 413 instead of a reset connection."""


@dataclass(slots=True)
class Upload:
    """What the form held: its small fields, and the file (committed under file_id)."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    num_bytes: int = 0


class _Parts:
    """python-multipart's callbacks: headers, then data of one part at a time."""

    def __init__(self, store: FileStore, file_id: str, max_bytes: int):
        self.upload = Upload()
        self._store, self._file_id, self._max_bytes = store, file_id, max_bytes
        self._header_name = b""
        self._headers: dict[bytes, bytes] = {}
        self._name = ""
        self._value = bytearray()
        self.writer: FileWriter | None = None
        self._in_file = False

    def on_part_begin(self) -> None:
        self._headers, self._value, self._in_file = {}, bytearray(), False

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        name = self._header_name.lower()
        self._headers[name] = self._headers.get(name, b"") + data[start:end]

    def on_header_end(self) -> None:
        self._header_name = b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = options.get(b"name", b"").decode("latin-1")
        if self._name == "file" and b"filename" in options:
            if self.writer is not None:
                raise bad_request("Send one file per upload.", "file")
            self.upload.filename = options[b"filename"].decode("utf-8", "replace")
            self.writer = self._store.writer(self._file_id, self._max_bytes)
            self._in_file = True

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            self.writer.write(data[start:end])
        elif len(self._value) + end - start > _MAX_FIELD_BYTES:
            raise bad_request(f"The form field {self._name!r} is too long.", self._name)
        else:
            self._value += data[start:end]

    def on_part_end(self) -> None:
        if not self._in_file:
            self.upload.fields[self._name] = self._value.decode("utf-8", "replace")


async def receive_upload(content_type: str, body: AsyncIterator[bytes], store: FileStore,
                         file_id: str, max_bytes: int) -> Upload:
    """Parse the form; the file is committed under `file_id` when the whole form was
    read (FileTooLarge or a 400 APIError, and nothing kept, otherwise)."""
    kind, options = parse_options_header(content_type)
    if kind != b"multipart/form-data" or b"boundary" not in options:
        raise bad_request("Upload files as multipart/form-data with fields `file` and "
                          "`purpose`.")
    parts = _Parts(store, file_id, max_bytes)
    parser = MultipartParser(options[b"boundary"], _callbacks(parts))
    try:
        async for chunk in body:
            parser.write(chunk)
        parser.finalize()
        if parser.state != MultipartState.END:
            raise FormParserError("the body ended before the closing boundary")
    except FormParserError as error:
        _abort(parts)
        raise bad_request(f"The multipart body could not be parsed: {error}") from error
    except FileTooLarge:
        _abort(parts)
        await _drain(body)
        raise
    except BaseException:
        _abort(parts)
        raise
    if parts.writer is None:
        raise bad_request("The form has no `file` field with a file.", "file")
    parts.upload.num_bytes = parts.writer.commit()
    return parts.upload


async def _drain(body: AsyncIterator[bytes]) -> None:
    num_bytes = 0
    async for chunk in body:
        num_bytes += len(chunk)
        if num_bytes > _MAX_DRAIN_BYTES:
            return


def _abort(parts: _Parts) -> None:
    if parts.writer is not None:
        parts.writer.abort()


def _callbacks(parts: _Parts) -> dict:
    names = ("on_part_begin", "on_part_data", "on_part_end", "on_header_field",
             "on_header_value", "on_header_end", "on_headers_finished")
    return {name: getattr(parts, name) for name in names}
