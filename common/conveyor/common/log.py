"""Structured logging that carries the request id and trace id of the current task."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

from opentelemetry import trace

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "conveyor_request_id", default=None
)


class _ContextFilter(logging.Filter):
    """Adds request_id and trace_id (from the active span) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get() or "-"
        span_context = trace.get_current_span().get_span_context()
        record.trace_id = format(span_context.trace_id, "032x") if span_context.is_valid else "-"
        return True


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(time.time(), 3),
            "level": record.levelname,
            "service": record.__dict__.get("service", record.name),
            "logger": record.name,
            "msg": record.getMessage(),
            "request_id": record.__dict__.get("request_id", "-"),
            "trace_id": record.__dict__.get("trace_id", "-"),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


TEXT_FORMAT = (
    "%(asctime)s %(levelname)s %(name)s [req=%(request_id)s trace=%(trace_id)s] %(message)s"
)


def setup_logging(service: str, level: str = "INFO", json_lines: bool = False) -> None:
    """Configure the root logger once per process for `service`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter())
    handler.setFormatter(_JsonFormatter() if json_lines else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("conveyor").info("%s logging at %s", service, level.upper())
