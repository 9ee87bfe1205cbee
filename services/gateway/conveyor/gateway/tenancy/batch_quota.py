"""The admission of a batch line: nothing reserved, nothing to settle.

Batch lines do not count against their tenant's interactive requests, tokens or
concurrency: how many run at once is bounded by the workers (lines_in_flight),
and their tokens still show in the gateway's metrics and the batch's usage.
It stands in for AdmissionControl in a batch line's TenantAdmission.
"""

from __future__ import annotations

from conveyor.gateway.tenancy.admission_control import Reservation
from conveyor.gateway.tenancy.quota_snapshot import NO_QUOTA
from conveyor.gateway.tenancy.tenant import Tenant


class BatchQuota:
    """AdmissionControl's interface, touching no quota."""

    async def admit(self, tenant: Tenant, request_id: str, num_prompt_tokens: int,
                    max_tokens: int) -> Reservation:
        return Reservation(request_id, tenant.tenant_id, num_prompt_tokens, max_tokens,
                           NO_QUOTA)

    async def settle(self, reservation: Reservation, num_completion_tokens: int, *,
                     refund_prompt: bool = False) -> int | None:
        return None
