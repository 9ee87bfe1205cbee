"""Errors of tenancy, each carrying its HTTP status and OpenAI error body.

The gateway maps any TenancyError with one handler:

    JSONResponse(error.body(), status_code=error.status_code, headers=error.headers())
"""

from __future__ import annotations

import math
from typing import Any


def openai_error_body(message: str, error_type: str, code: str | None = None,
                      param: str | None = None) -> dict[str, Any]:
    """The body OpenAI's API answers errors with."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class TenancyError(Exception):
    """A request refused by auth, quota or priority rules."""

    status_code = 400
    error_type = "invalid_request_error"
    code: str | None = None
    param: str | None = None

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def body(self) -> dict[str, Any]:
        return openai_error_body(self.message, self.error_type, self.code, self.param)

    def headers(self) -> dict[str, str]:
        return {}


class MissingApiKey(TenancyError):
    """No `Authorization: Bearer <key>` header."""

    status_code = 401
    code = "invalid_api_key"

    def __init__(self) -> None:
        super().__init__("You didn't provide an API key. Send it as 'Authorization: Bearer "
                         "<key>'.")

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class InvalidApiKey(TenancyError):
    """A key that is unknown, malformed or revoked (deliberately not told apart)."""

    status_code = 401
    code = "invalid_api_key"

    def __init__(self, key: str):
        super().__init__(f"Incorrect API key provided: {redact_key(key)}.")

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class PermissionDenied(TenancyError):
    """An authenticated caller asking for what its key does not allow (an admin endpoint)."""

    status_code = 403
    error_type = "permission_denied_error"
    code = "permission_denied"


class RateLimited(TenancyError):
    """Over one of the tenant's limits now; `retry_after_s` says when it would fit."""

    status_code = 429
    error_type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, limit: str, retry_after_s: float,
                 rate_limit_headers: dict[str, str] | None = None):
        super().__init__(message)
        self.limit = limit
        """Which limit refused: "requests", "tokens" or "concurrency"."""
        self.retry_after_s = retry_after_s
        self._rate_limit_headers = rate_limit_headers or {}

    def headers(self) -> dict[str, str]:
        retry_after = max(1, math.ceil(self.retry_after_s))
        return {**self._rate_limit_headers, "Retry-After": str(retry_after)}


class RequestTooLarge(TenancyError):
    """Prompt tokens + max_tokens exceed the whole per-minute token budget: never fits."""

    status_code = 429
    error_type = "rate_limit_exceeded"
    code = "request_too_large"
    param = "max_tokens"


class PriorityNotAllowed(TenancyError):
    """The request's `priority` is outside what its tier allows."""

    code = "invalid_priority"
    param = "priority"


class TimelineNotFound(TenancyError):
    """No timeline for this id that the caller may read (expired, unknown or another tenant's)."""

    status_code = 404
    code = "request_not_found"

    def __init__(self, request_id: str):
        super().__init__(f"No request {request_id!r} found for this API key (it may have "
                         "expired).")


class TierNotConfigured(TenancyError):
    """A stored key names a tier the deployment no longer defines (operator error)."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, tier: str):
        super().__init__(f"This API key's tier {tier!r} is not configured on the server; "
                         "define it in CONVEYOR_GATEWAY_TIERS.")


def redact_key(key: str) -> str:
    """Enough of a key to recognise it in a message, never enough to use it."""
    if len(key) <= 8:
        return "*" * len(key)
    return f"{key[:4]}{'*' * 8}{key[-4:]}"
