"""The error of a constraint the engine cannot run."""

from __future__ import annotations

from conveyor.engine.request_validation import InvalidRequestError


class InvalidConstraint(InvalidRequestError):
    """The constraint does not compile (the grammar library's message), took longer than
    the compile timeout, or the output a resumed request already has breaks it. The
    caller's fault: INVALID_ARGUMENT (reason invalid_request) over gRPC."""
