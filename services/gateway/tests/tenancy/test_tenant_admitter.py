"""The gateway seam over Redis: key -> tenant -> admission -> settlement."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from conveyor.common.redis_scripts import run_script_calls
from conveyor.gateway.tenancy.admission import TenantAdmitter
from conveyor.gateway.tenancy.api_keys import ApiKeyStore
from conveyor.gateway.tenancy.errors import MissingApiKey, RateLimited
from conveyor.gateway.tenancy.settings import TenancySettings


@dataclass
class Usage:
    completion_tokens: int


def settings(prefix: str, **overrides) -> TenancySettings:
    return TenancySettings(redis_prefix=prefix, tiers={"free": {"tokens_per_minute": 1000}},
                           **overrides)


async def test_a_keyed_request_is_admitted_and_settled(redis, prefix):
    admitter = TenantAdmitter.from_settings(redis, settings(prefix))
    key = (await ApiKeyStore(redis, settings(prefix).tier_table, prefix=prefix)
           .create("acme", "free")).key
    tenant = await admitter.authenticate({"authorization": f"Bearer {key}"})
    admission = await admitter.admit(tenant, 100, 900)
    assert admission.rate_limit_headers["x-ratelimit-remaining-tokens"] == "0"
    assert admission.engine_priority(None) == 20 and admission.engine_priority(3) == 23
    with pytest.raises(RateLimited):
        await admitter.admit(tenant, 100, 100)
    await run_script_calls(redis, [admission.settle_call(Usage(completion_tokens=700))])
    await admitter.admit(tenant, 100, 100)


async def test_settle_without_usage_returns_the_prompt_too(redis, prefix):
    admitter = TenantAdmitter.from_settings(redis, settings(prefix, auth_enabled=False,
                                                            anonymous_tier="free"))
    tenant = await admitter.authenticate({})
    admission = await admitter.admit(tenant, 500, 500)
    await run_script_calls(redis, [admission.settle_call(None), admission.settle_call(None)])
    await admitter.admit(tenant, 500, 500)


async def test_auth_on_needs_a_key(redis, prefix):
    admitter = TenantAdmitter.from_settings(redis, settings(prefix))
    assert admitter.auth_enabled
    with pytest.raises(MissingApiKey):
        await admitter.authenticate({})


async def test_auth_off_is_the_anonymous_unlimited_tenant(redis, prefix):
    admitter = TenantAdmitter.from_settings(redis, settings(prefix, auth_enabled=False))
    tenant = await admitter.authenticate({"authorization": "Bearer whatever"})
    assert (tenant.tenant_id, tenant.tier.name) == ("anonymous", "unlimited")
    assert (await admitter.admit(tenant, 10**6, 10**6)).rate_limit_headers == {}
