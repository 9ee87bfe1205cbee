"""OpenAI error bodies and the one mapping from failures to them.

Every error is `{"error": {"message", "type", "param", "code"}}`. 400 is the
caller's mistake (or a LoRA adapter no engine serves adapters for), 401 a missing or
wrong API key, 403 a key not allowed to do this (an admin endpoint), 404 an unknown
model (or request timeline), 429 over a tenant's quota (with Retry-After), 503 (with
Retry-After) no capacity right now, 504 a request past its deadline, and 500 a real
fault.
"""

from __future__ import annotations

import logging

from redis.exceptions import RedisError
from starlette.responses import JSONResponse

from conveyor.common.errors import CONTEXT_LENGTH_EXCEEDED, QUEUE_FULL
from conveyor.gateway.clients.upstream import UpstreamError
from conveyor.gateway.routing.directory import NoEngineAvailable
from conveyor.gateway.routing.router import AdaptersNotServed
from conveyor.gateway.tenancy.errors import TenancyError

log = logging.getLogger("conveyor.gateway.errors")

_BAD_INPUT_CODES = {"INVALID_ARGUMENT", "OUT_OF_RANGE", "FAILED_PRECONDITION"}
_BUSY_CODES = {"UNAVAILABLE", "RESOURCE_EXHAUSTED"}


class ClientDisconnected(Exception):
    """The client went away before the response was complete."""


class RequestTimedOut(Exception):
    """The request ran past its deadline."""


class EngineAborted(Exception):
    """The engine ended the request itself (it is draining or failed to schedule it)."""


class APIError(Exception):
    """An error to send to the client as it is."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The JSON response of `error`, with `headers` (e.g. x-ratelimit-*) and its own."""
    return JSONResponse(error.body(), status_code=error.status,
                        headers={**(headers or {}), **error.headers})


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def context_length_exceeded(message: str, param: str) -> APIError:
    return APIError(400, message, "invalid_request_error", param, CONTEXT_LENGTH_EXCEEDED)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "invalid_request_error",
                    "model", "model_not_found")


def unavailable(message: str, retry_after_s: int, code: str = "service_unavailable") -> APIError:
    return APIError(503, message, "service_unavailable_error", None, code,
                    {"Retry-After": str(retry_after_s)})


def internal_error(message: str = "internal error; see the gateway's log") -> APIError:
    return APIError(500, message, "internal_error", None, "internal_error")


def to_api_error(error: BaseException, prompt_param: str | None, retry_after_s: int) -> APIError:
    """The client-facing form of any failure while serving a request."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, TenancyError):
        return from_tenancy(error)
    if isinstance(error, UpstreamError):
        return _from_upstream(error, prompt_param, retry_after_s)
    if isinstance(error, RedisError):
        log.error("Redis failed while serving a request: %s", error)
        return unavailable("the gateway cannot reach its Redis (keys, quotas, routing)",
                           retry_after_s, "redis_unavailable")
    if isinstance(error, AdaptersNotServed):
        return APIError(400, str(error), "invalid_request_error", "model", "lora_not_served")
    if isinstance(error, NoEngineAvailable):
        return unavailable(f"no engine can take the request now ({error})", retry_after_s,
                           "no_engine_available")
    if isinstance(error, EngineAborted):
        return unavailable("the engine aborted the request; retry", retry_after_s)
    if isinstance(error, RequestTimedOut):
        return APIError(504, "the request took longer than the gateway's request timeout",
                        "timeout_error", None, "request_timeout")
    log.error("unexpected error while serving a request", exc_info=error)
    return internal_error()


def from_tenancy(error: TenancyError) -> APIError:
    """Auth, quota and priority refusals keep their status, body and headers."""
    return APIError(error.status_code, error.message, error.error_type, error.param,
                    error.code, error.headers())


def _from_upstream(error: UpstreamError, prompt_param: str | None,
                   retry_after_s: int) -> APIError:
    if error.reason == CONTEXT_LENGTH_EXCEEDED:
        return context_length_exceeded(error.message, prompt_param)
    if error.reason == QUEUE_FULL:
        return unavailable(f"the engines are at capacity ({error.message}); retry later",
                           retry_after_s, "engine_overloaded")
    if error.code in _BAD_INPUT_CODES:
        return bad_request(error.message)
    if error.code in _BUSY_CODES or error.code == "DEADLINE_EXCEEDED":
        return unavailable(f"the {error.service} service is unavailable: {error.message}",
                           retry_after_s)
    log.error("%s failed: %s %s", error.service, error.code, error.message)
    return internal_error(f"the {error.service} service failed: {error.code}")
