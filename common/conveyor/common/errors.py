"""Machine-readable error reasons that travel in gRPC trailing metadata, so
the gateway can map a status to the right OpenAI error code."""

ERROR_REASON_KEY = "conveyor-error-reason"
"""Trailing metadata key whose value is one of the reasons below."""

ERROR_SERVICE_KEY = "conveyor-error-service"
"""Trailing metadata key naming the service whose failure a relaying service passes on
(detok passes on its engine's: "engine"); absent: the failure is the callee's own."""

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""prompt tokens + max_tokens > max_model_len; the message names both numbers."""

INVALID_REQUEST = "invalid_request"
"""Any other bad input; the message says what."""

QUEUE_FULL = "queue_full"
"""The engine's waiting queue is full (RESOURCE_EXHAUSTED): the request was refused or pushed
out by a higher-priority one before it ran; retry later or on another engine."""
