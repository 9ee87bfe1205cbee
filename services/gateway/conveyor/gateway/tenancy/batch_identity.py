"""Who a batch line is: the batch's tenant, at its tier's batch priority.

A batch worker sends each line to the gateway's own completions endpoints with
the internal token (`Authorization: Bearer <CONVEYOR_GATEWAY_BATCH_TOKEN>`) and
the batch's id (`X-Conveyor-Batch-Id`). The tenant and tier are read from the
batch's record in Redis, never from the worker's headers, so a line is always
billed to the tenant whose key created the batch. An empty token setting refuses
every batch line.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from conveyor.common.batch_store import BatchStore
from conveyor.gateway.tenancy.api_keys import bearer_key
from conveyor.gateway.tenancy.errors import InvalidApiKey, TenancyError, TierNotConfigured
from conveyor.gateway.tenancy.tenant import Tenant
from conveyor.gateway.tenancy.tiers import Tier, batch_tier

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
