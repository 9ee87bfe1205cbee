"""Where uploaded and generated files live: one small interface, a directory by default.

The gateway writes uploads and serves downloads; batch workers read inputs and
write outputs. Both see the same store: locally one folder, in compose a volume,
in Kubernetes a ReadWriteMany volume (or an object store behind this interface).
File ids are chosen by the caller (`file-<hex>`); the store only holds bytes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import BinaryIO, Protocol

_FILE_ID = re.compile(r"file-[A-Za-z0-9_-]{1,64}")


class FileTooLarge(Exception):
    """An upload went past the store's size limit; nothing was kept."""

    def __init__(self, max_bytes: int):
        super().__init__(f"the file is larger than the limit of {max_bytes} bytes")
        self.max_bytes = max_bytes


class FileWriter(Protocol):
    """A file being written: nothing is visible under its id until `commit`."""

    def write(self, data: bytes) -> None: ...

    def commit(self) -> int:
        """Make the file visible under its id; returns its size in bytes."""

    def abort(self) -> None:
        """Drop what was written (safe after commit: then it does nothing)."""


class FileStore(Protocol):
    """Bytes by file id. A committed file never changes until it is deleted, so
    a reader opened at any time sees one whole file."""

    def writer(self, file_id: str, max_bytes: int | None = None) -> FileWriter: ...

    def open(self, file_id: str) -> BinaryIO:
        """The file for reading (FileNotFoundError if there is none)."""

    def delete(self, file_id: str) -> None:
        """Remove the file; a missing one is not an error."""


class DirectoryFileStore:
    """Files in one folder, each written to a temporary name and renamed on commit."""

    def __init__(self, root: Path | str):
        self.root = Path(root).expanduser()

    def writer(self, file_id: str, max_bytes: int | None = None) -> _DirectoryWriter:
        self.root.mkdir(parents=True, exist_ok=True)
        return _DirectoryWriter(self._path(file_id), max_bytes)

    def open(self, file_id: str) -> BinaryIO:
        return open(self._path(file_id), "rb")  # noqa: SIM115 - the caller closes it

    def delete(self, file_id: str) -> None:
        self._path(file_id).unlink(missing_ok=True)

    def _path(self, file_id: str) -> Path:
        if not _FILE_ID.fullmatch(file_id):
            raise ValueError(f"not a file id: {file_id!r}")
        return self.root / file_id


class _DirectoryWriter:
    def __init__(self, path: Path, max_bytes: int | None):
        self._path = path
        self._partial = path.with_name(f".{path.name}.{os.getpid()}.{id(self)}.part")
        self._file = open(self._partial, "wb")  # noqa: SIM115 - closed by commit/abort
        self._max_bytes = max_bytes
        self.num_bytes = 0

    def write(self, data: bytes) -> None:
        self.num_bytes += len(data)
        if self._max_bytes is not None and self.num_bytes > self._max_bytes:
            self.abort()
            raise FileTooLarge(self._max_bytes)
        self._file.write(data)

    def commit(self) -> int:
        self._file.close()
        os.replace(self._partial, self._path)
        return self.num_bytes

    def abort(self) -> None:
        self._file.close()
        self._partial.unlink(missing_ok=True)
