"""Batch lines: the internal token + batch id become the batch's tenant at its tier's
batch priority, and their admission leaves the tenant's interactive quota alone."""

from __future__ import annotations

import pytest

from conveyor.common.batch_record import BatchRecord
from conveyor.common.batch_store import BatchStore
from conveyor.gateway.tenancy.admission import TenantAdmitter, engine_priority
from conveyor.gateway.tenancy.api_keys import ApiKeyStore
from conveyor.gateway.tenancy.batch_lines import BatchLinesRefused, UnknownBatch
from conveyor.gateway.tenancy.errors import InvalidApiKey
from conveyor.gateway.tenancy.settings import TenancySettings
from conveyor.gateway.tenancy.tiers import BATCH_PRIORITY_BASE, DEFAULT_TIERS, build_tiers

TOKEN = "internal-token"


def line_headers(batch_id: str = "batch_1", token: str = TOKEN) -> dict[str, str]:
    return {"authorization": f"Bearer {token}", "x-conveyor-batch-id": batch_id}


async def admitter_with_batch(redis, prefix, token: str = TOKEN) -> TenantAdmitter:
    settings = TenancySettings(redis_prefix=prefix, batch_token=token)
    await BatchStore(redis, prefix).create(BatchRecord(
        "batch_1", "acme", "free", "/v1/completions", "file-in", 1, 2))
    return TenantAdmitter.from_settings(redis, settings)


async def test_a_batch_line_is_the_batchs_tenant_behind_every_interactive_priority(
        redis, prefix):
    admitter = await admitter_with_batch(redis, prefix)
    tenant = await admitter.authenticate(line_headers())
    assert (tenant.tenant_id, tenant.batch_id, tenant.tier.name) == ("acme", "batch_1", "free")
    worst_interactive = max(t.priority + t.max_priority_offset for t in DEFAULT_TIERS.values())
    assert engine_priority(tenant.tier, None) == BATCH_PRIORITY_BASE + 20 > worst_interactive


async def test_batch_lines_take_no_interactive_quota(redis, prefix):
    admitter = await admitter_with_batch(redis, prefix)
    tenant = await admitter.authenticate(line_headers())
    for _ in range(30):  # the free tier allows 10 requests a minute, 2 at once
        admission = admitter.admission(tenant, 100, 100)
        await admission.reserve()
    assert admission.rate_limit_headers == {}
    assert [key async for key in redis.scan_iter(match=f"{prefix}:quota:*")] == []
    key = (await ApiKeyStore(redis, build_tiers({}), prefix=prefix).create("acme", "free")).key
    interactive = await admitter.authenticate({"authorization": f"Bearer {key}"})
    await admitter.admit(interactive, 10, 10)


@pytest.mark.parametrize(("token", "headers", "error"), [
    ("", line_headers(), BatchLinesRefused),
    (TOKEN, line_headers(token="guess"), InvalidApiKey),
    (TOKEN, line_headers(batch_id="batch_none"), UnknownBatch),
])
async def test_bad_batch_lines_are_refused(redis, prefix, token, headers, error):
    admitter = await admitter_with_batch(redis, prefix, token)
    with pytest.raises(error):
        await admitter.authenticate(headers)


def test_no_tier_may_reach_the_batch_priorities():
    with pytest.raises(ValueError, match="batch lines run"):
        build_tiers({"free": {"priority": BATCH_PRIORITY_BASE - 5}})
