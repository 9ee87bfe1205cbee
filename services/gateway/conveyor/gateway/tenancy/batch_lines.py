"""Batch lines: a batch worker sends each line with the internal token
(`Authorization: Bearer <CONVEYOR_GATEWAY_BATCH_TOKEN>`) and the batch's id
(`X-Conveyor-Batch-Id`). The tenant and tier are read from the batch's record in
Redis, never from the worker's headers; their admission (`BatchQuota`) touches none
of the tenant's interactive limits.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from conveyor.common.batch_store import BatchStore
from conveyor.common.redis_scripts import ScriptCall
from conveyor.gateway.tenancy.api_keys import Tenant, bearer_key
from conveyor.gateway.tenancy.errors import (
    InvalidApiKey,
    TenancyError,
    TierNotConfigured,
)
from conveyor.gateway.tenancy.quota_ledger import NO_QUOTA, Reservation
from conveyor.gateway.tenancy.tiers import Tier, batch_tier
from conveyor.gateway.tenancy.timeline import TimelineWrite


class BatchQuota:
    """AdmissionControl's interface, touching no quota (nor Redis: it carries no
    timeline, which its request writes on its own)."""

    carries_timeline = False

    async def admit(self, tenant: Tenant, request_id: str, num_prompt_tokens: int,
                    max_tokens: int, timeline: TimelineWrite | None = None) -> Reservation:
        return Reservation(request_id, tenant.tenant_id, num_prompt_tokens, max_tokens,
                           NO_QUOTA)

    async def settle(self, reservation: Reservation, num_completion_tokens: int, *,
                     refund_prompt: bool = False,
                     timeline: TimelineWrite | None = None) -> int | None:
        return None

    def settle_call(self, reservation: Reservation, num_completion_tokens: int, *,
                    refund_prompt: bool = False,
                    timeline: TimelineWrite | None = None) -> ScriptCall | None:
        return None


BATCH_ID_HEADER = "x-conveyor-batch-id"


class BatchLinesRefused(TenancyError):
    """A batch line reached a gateway whose batch token is not set."""

    status_code = 401
    code = "batch_lines_refused"

    def __init__(self) -> None:
        super().__init__("This gateway takes no batch lines: CONVEYOR_GATEWAY_BATCH_TOKEN is "
                         "not set.")


class UnknownBatch(TenancyError):
    status_code = 404
    error_type = "not_found_error"
    code = "batch_not_found"

    def __init__(self, batch_id: str):
        super().__init__(f"No batch {batch_id!r} to run a line of.")


class BatchIdentity:
    """Turns a worker's batch-line headers into the batch's tenant."""

    def __init__(self, token: str, batches: BatchStore, tiers: dict[str, Tier]):
        self._token = token
        self._batches = batches
        self._tiers = tiers

    async def authenticate(self, headers: Mapping[str, str]) -> Tenant:
        if not self._token:
            raise BatchLinesRefused()
        key = bearer_key(headers.get("authorization"))
        if not hmac.compare_digest(key.encode(), self._token.encode()):
            raise InvalidApiKey(key)
        batch_id = headers[BATCH_ID_HEADER]
        record = await self._batches.get(batch_id)
        if record is None:
            raise UnknownBatch(batch_id)
        tier = self._tiers.get(record.tier)
        if tier is None:
            raise TierNotConfigured(record.tier)
        return Tenant(record.tenant_id, batch_tier(tier), batch_id=batch_id)
