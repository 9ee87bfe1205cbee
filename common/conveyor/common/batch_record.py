"""A batch's state as stored in Redis, and its OpenAI Batch object.

Statuses move validating -> in_progress -> finalizing -> completed, or end in
failed (the input did not validate), expired (the window ran out) or
cancelling -> cancelled. Each status has its `<status>_at` time. While a batch
is `finalizing`, `ending` says which terminal status the finalizer gives it
(completed, or expired when the window ran out).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
"""The endpoints a batch may target."""
COMPLETION_WINDOW = "24h"
COMPLETION_WINDOW_S = 24 * 3600


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED,
             BatchStatus.CANCELLED}
_TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
               "cancelling_at", "cancelled_at")
_INTS = ("created_at", "expires_at", "total", "completed", "failed", "input_tokens",
         "output_tokens", "cached_tokens")


@dataclass(slots=True)
class BatchRecord:
    """Everything stored about one batch (one Redis hash)."""

    batch_id: str
    tenant_id: str
    tier: str
    endpoint: str
    input_file_id: str
    created_at: int
    expires_at: int
    completion_window: str = COMPLETION_WINDOW
    status: BatchStatus = BatchStatus.VALIDATING
    metadata: dict[str, str] | None = None
    errors: list[dict] | None = None
    """Validation errors ({code, message, param, line}) of a failed batch."""
    total: int = 0
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    ending: str | None = None
    timestamps: dict[str, int] = field(default_factory=dict)
    """`<status>_at` of each status reached."""

    @property
    def num_done(self) -> int:
        return self.completed + self.failed

    def to_hash(self) -> dict[str, str]:
        values = asdict(self)
        timestamps = values.pop("timestamps")
        row = {k: _encode(v) for k, v in values.items() if v is not None}
        return {**row, **{k: str(v) for k, v in timestamps.items()}}

    @classmethod
    def from_hash(cls, row: dict[str, str]) -> BatchRecord:
        values: dict = {k: v for k, v in row.items() if k not in _TIMESTAMPS}
        for name in _INTS:
            if name in values:
                values[name] = int(values[name])
        for name in ("metadata", "errors"):
            if name in values:
                values[name] = json.loads(values[name])
        values["status"] = BatchStatus(values["status"])
        values["timestamps"] = {k: int(row[k]) for k in _TIMESTAMPS if k in row}
        return cls(**values)

    def to_openai(self) -> dict:
        """The Batch object as OpenAI's API (and its `openai` client) has it."""
        errors = None if not self.errors else {"object": "list", "data": self.errors}
        return {
            "id": self.batch_id, "object": "batch", "endpoint": self.endpoint,
            "errors": errors, "input_file_id": self.input_file_id,
            "completion_window": self.completion_window, "status": str(self.status),
            "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "expires_at": self.expires_at,
            **{name: self.timestamps.get(name) for name in _TIMESTAMPS},
            "request_counts": {"total": self.total, "completed": self.completed,
                               "failed": self.failed},
            "metadata": self.metadata,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                      "total_tokens": self.input_tokens + self.output_tokens,
                      "input_tokens_details": {"cached_tokens": self.cached_tokens},
                      "output_tokens_details": {"reasoning_tokens": 0}},
        }


def _encode(value: object) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)
