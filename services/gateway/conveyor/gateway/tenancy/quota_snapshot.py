"""A tenant's quota as of one admission, and the `x-ratelimit-*` headers it becomes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class QuotaSnapshot:
    """Limits and what is left of them; None for an unlimited tier's limit.

    `reset_*_s` is how long until the limit is fully replenished (OpenAI's
    meaning of x-ratelimit-reset-*).
    """

    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_s: float
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens_s: float
    num_concurrent: int
    """Requests of the tenant in flight, this one included when admitted."""

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers (those of unlimited limits left out)."""
        headers: dict[str, str] = {}
        if self.limit_requests is not None:
            headers["x-ratelimit-limit-requests"] = str(self.limit_requests)
            headers["x-ratelimit-remaining-requests"] = str(self.remaining_requests)
            headers["x-ratelimit-reset-requests"] = format_duration(self.reset_requests_s)
        if self.limit_tokens is not None:
            headers["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            headers["x-ratelimit-remaining-tokens"] = str(self.remaining_tokens)
            headers["x-ratelimit-reset-tokens"] = format_duration(self.reset_tokens_s)
        return headers


def format_duration(seconds: float) -> str:
    """A duration as OpenAI writes it in reset headers: 250ms, 12s, 1.5s, 6m0s, 1h2m3s."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{round(secs, 3):g}s"
    if minutes or hours:
        text = f"{int(minutes)}m{text}"
    if hours:
        text = f"{int(hours)}h{text}"
    return text


NO_QUOTA = QuotaSnapshot(None, None, 0.0, None, None, 0.0, 0)
"""The snapshot of a reservation not made yet (no headers)."""
