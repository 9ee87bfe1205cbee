"""The engine's scheduling priority of a request (lower runs first).

A request's optional `priority` field is an offset from its tier's priority:
0 (the default) runs at the tier's priority, a larger value later (e.g. a
tenant's own background jobs). A request can never run ahead of its tier, and
can go at most `tier.max_priority_offset` behind it.
"""

from __future__ import annotations

from conveyor.gateway.tenancy.errors import PriorityNotAllowed
from conveyor.gateway.tenancy.tiers import Tier


def engine_priority(tier: Tier, requested: int | None = None) -> int:
    """tier.priority + requested; PriorityNotAllowed (400) outside 0..max_priority_offset."""
    offset = 0 if requested is None else requested
    if not 0 <= offset <= tier.max_priority_offset:
        raise PriorityNotAllowed(
            f"priority must be between 0 (the default) and {tier.max_priority_offset} for tier "
            f"{tier.name!r}; larger values run later, got {requested}.")
    return tier.priority + offset
