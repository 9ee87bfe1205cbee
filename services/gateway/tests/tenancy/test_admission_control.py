"""Admission control against the real Redis: limits, atomicity, settlement, two gateways."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from conveyor.gateway.tenancy.api_keys import Tenant
from conveyor.gateway.tenancy.errors import RateLimited, RequestTooLarge
from conveyor.gateway.tenancy.quota_ledger import AdmissionControl
from conveyor.gateway.tenancy.tiers import Tier


def tenant(rpm: int | None = None, tpm: int | None = None, concurrent: int | None = None,
           name: str = "acme") -> Tenant:
    return Tenant(name, Tier("t", priority=10, requests_per_minute=rpm, tokens_per_minute=tpm,
                             max_concurrent_requests=concurrent))


def request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


@pytest.fixture
def control(redis, prefix):
    return AdmissionControl(redis, prefix=prefix)


async def test_sixth_request_in_a_minute_is_refused_with_retry_after(control):
    acme = tenant(rpm=5)
    for _ in range(5):
        await control.admit(acme, request_id(), 10, 10)
    with pytest.raises(RateLimited) as refused:
        await control.admit(acme, request_id(), 10, 10)
    error = refused.value
    assert (error.status_code, error.limit) == (429, "requests")
    assert 11 < error.retry_after_s <= 12  # one request's worth of a 5-per-minute budget
    assert error.headers()["Retry-After"] == "12"
    assert error.headers()["x-ratelimit-remaining-requests"] == "0"
    assert error.body()["error"]["type"] == "rate_limit_exceeded"


async def test_admission_reports_rate_limit_headers(control):
    reservation = await control.admit(tenant(rpm=5, tpm=1000), request_id(), 100, 50)
    headers = reservation.quota.headers()
    assert headers["x-ratelimit-limit-requests"] == "5"
    assert headers["x-ratelimit-remaining-requests"] == "4"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    assert reservation.quota.reset_requests_s == pytest.approx(12, abs=0.01)
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-tokens"] == "850"
    assert reservation.quota.reset_tokens_s == pytest.approx(9, abs=0.01)
    assert reservation.quota.num_concurrent == 1


async def test_concurrent_admissions_admit_exactly_what_fits_the_token_budget(control):
    acme = tenant(tpm=1000)
    results = await asyncio.gather(*(control.admit(acme, request_id(), 60, 40) for _ in range(20)),
                                   return_exceptions=True)
    admitted = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, RateLimited)]
    assert (len(admitted), len(refused)) == (10, 10)
    assert {r.limit for r in refused} == {"tokens"}


async def test_two_gateways_share_the_same_limits(redis, other_redis, prefix):
    first = AdmissionControl(redis, prefix=prefix)
    second = AdmissionControl(other_redis, prefix=prefix)
    acme = tenant(rpm=5)
    for control in (first, second, first, second, first):
        await control.admit(acme, request_id(), 1, 1)
    for control in (first, second):
        with pytest.raises(RateLimited):
            await control.admit(acme, request_id(), 1, 1)


async def test_tenants_have_separate_budgets(control):
    await control.admit(tenant(rpm=1, name="a"), request_id(), 1, 1)
    await control.admit(tenant(rpm=1, name="b"), request_id(), 1, 1)
    with pytest.raises(RateLimited):
        await control.admit(tenant(rpm=1, name="a"), request_id(), 1, 1)


async def test_settlement_returns_unused_tokens_once(control):
    acme = tenant(tpm=1000)
    reservation = await control.admit(acme, request_id(), 100, 900)
    with pytest.raises(RateLimited):
        await control.admit(acme, request_id(), 100, 700)
    assert await control.settle(reservation, num_completion_tokens=100) == 800
    assert await control.settle(reservation, num_completion_tokens=100) is None
    later = await control.admit(acme, request_id(), 100, 700)
    assert later.quota.remaining_tokens < 200  # the refund was not applied twice


async def test_client_gone_before_any_token_returns_all_of_max_tokens(control):
    acme = tenant(tpm=1000)
    reservation = await control.admit(acme, request_id(), 300, 700)
    assert await control.settle(reservation, num_completion_tokens=0) == 700
    assert (await control.admit(acme, request_id(), 0, 700)).quota.remaining_tokens <= 5


async def test_refund_prompt_returns_everything_for_a_request_that_never_ran(control):
    acme = tenant(tpm=1000)
    reservation = await control.admit(acme, request_id(), 300, 700)
    assert await control.settle(reservation, 0, refund_prompt=True) == 1000
    await control.admit(acme, request_id(), 300, 700)


async def test_concurrency_slot_is_held_until_settled(control):
    acme = tenant(concurrent=2)
    first = await control.admit(acme, request_id(), 1, 1)
    await control.admit(acme, request_id(), 1, 1)
    with pytest.raises(RateLimited) as refused:
        await control.admit(acme, request_id(), 1, 1)
    assert refused.value.limit == "concurrency"
    await control.settle(first, 1)
    await control.admit(acme, request_id(), 1, 1)


async def test_slot_of_a_reservation_never_settled_frees_when_its_lease_runs_out(redis, prefix):
    control = AdmissionControl(redis, prefix=prefix, reservation_ttl_s=0.2)
    acme = tenant(concurrent=1)
    abandoned = await control.admit(acme, request_id(), 1, 1)
    with pytest.raises(RateLimited):
        await control.admit(acme, request_id(), 1, 1)
    await asyncio.sleep(0.3)
    await control.admit(acme, request_id(), 1, 1)
    assert await control.settle(abandoned, 0) is None


async def test_a_refused_admission_reserves_nothing(control):
    acme = tenant(rpm=10, tpm=1000)
    await control.admit(acme, request_id(), 500, 400)
    with pytest.raises(RateLimited):
        await control.admit(acme, request_id(), 100, 100)
    reservation = await control.admit(acme, request_id(), 50, 50)
    assert reservation.quota.remaining_requests == 8
    assert reservation.quota.remaining_tokens <= 5  # plus what refilled meanwhile


async def test_budget_refills_with_time(redis, prefix):
    control = AdmissionControl(redis, prefix=prefix, period_s=0.4)
    acme = tenant(rpm=2)
    await control.admit(acme, request_id(), 1, 1)
    await control.admit(acme, request_id(), 1, 1)
    with pytest.raises(RateLimited) as refused:
        await control.admit(acme, request_id(), 1, 1)
    assert 0.1 < refused.value.retry_after_s <= 0.2
    await asyncio.sleep(refused.value.retry_after_s + 0.02)
    await control.admit(acme, request_id(), 1, 1)


async def test_request_larger_than_the_whole_budget_is_refused_as_too_large(control):
    with pytest.raises(RequestTooLarge) as refused:
        await control.admit(tenant(tpm=1000), request_id(), 600, 500)
    assert refused.value.status_code == 429
    assert refused.value.body()["error"]["code"] == "request_too_large"
    assert "Retry-After" not in refused.value.headers()


async def test_unlimited_tier_is_always_admitted_without_headers(control):
    for _ in range(50):
        reservation = await control.admit(tenant(), request_id(), 10_000, 10_000)
    assert reservation.quota.headers() == {}


async def test_admitting_the_same_request_id_twice_is_a_bug(control):
    rid = request_id()
    await control.admit(tenant(rpm=5), rid, 1, 1)
    with pytest.raises(ValueError, match="already admitted"):
        await control.admit(tenant(rpm=5), rid, 1, 1)
