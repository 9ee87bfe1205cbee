"""A failed call to a service, as the gateway sees it: `UpstreamError`, never a gRPC
exception past the clients."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc

from conveyor.common.errors import ERROR_REASON_KEY, ERROR_SERVICE_KEY


class UpstreamError(Exception):
    """A gRPC call failed: which service, the status code's name, its message and
    the machine-readable reason from the trailing metadata (None when absent)."""

    def __init__(self, service: str, code: str, message: str, reason: str | None = None):
        super().__init__(f"{service}: {code}: {message}")
        self.service = service
        self.code = code
        self.message = message
        self.reason = reason

    @classmethod
    def from_rpc(cls, service: str, error: grpc.aio.AioRpcError) -> UpstreamError:
        """`service`'s failed call; a failure it passed on names its own service (detok
        passes on its engine's)."""
        return cls(_metadata(error, ERROR_SERVICE_KEY) or service, error.code().name,
                   error.details() or "", _metadata(error, ERROR_REASON_KEY))


def _metadata(error: grpc.aio.AioRpcError, wanted: str) -> str | None:
    for key, value in error.trailing_metadata() or ():
        if key == wanted:
            return value.decode() if isinstance(value, bytes) else value
    return None


@contextlib.contextmanager
def translate_rpc_errors(service: str) -> Iterator[None]:
    """Re-raise a gRPC error raised inside the block as UpstreamError."""
    try:
        yield
    except grpc.aio.AioRpcError as error:
        raise UpstreamError.from_rpc(service, error) from error
