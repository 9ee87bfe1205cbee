"""Tiers, their overrides from settings, engine priorities, error bodies and header formats."""

from __future__ import annotations

import pytest

from conveyor.gateway.tenancy.admission import engine_priority
from conveyor.gateway.tenancy.api_keys import Tenant
from conveyor.gateway.tenancy.errors import PriorityNotAllowed, RateLimited, openai_error_body
from conveyor.gateway.tenancy.quota_ledger import QuotaSnapshot, format_duration
from conveyor.gateway.tenancy.settings import TenancySettings
from conveyor.gateway.tenancy.tiers import DEFAULT_TIERS, CacheSharing, build_tiers


def test_default_tiers_run_premium_first_and_batch_last():
    order = sorted(DEFAULT_TIERS.values(), key=lambda t: t.priority)
    assert [t.name for t in order][0] == "premium"
    assert order[-1].name == "batch"


def test_settings_override_a_tier_field_and_add_tiers(monkeypatch):
    monkeypatch.setenv("CONVEYOR_GATEWAY_TIERS", '{"free": {"requests_per_minute": 5}, '
                       '"gold": {"priority": 5, "requests_per_minute": 300, '
                       '"tokens_per_minute": null, "max_concurrent_requests": 8, '
                       '"cache_sharing": "global"}}')
    tiers = TenancySettings().tier_table
    assert tiers["free"].requests_per_minute == 5
    assert tiers["free"].tokens_per_minute == DEFAULT_TIERS["free"].tokens_per_minute
    assert tiers["gold"].cache_sharing is CacheSharing.GLOBAL
    assert tiers["gold"].tokens_per_minute is None


def test_overrides_name_the_bad_field():
    with pytest.raises(ValueError, match="unknown field"):
        build_tiers({"free": {"rpm": 5}})
    with pytest.raises(ValueError, match="must set priority"):
        build_tiers({"gold": {"priority": 1}})
    with pytest.raises(ValueError, match="requests_per_minute must be >= 1"):
        build_tiers({"free": {"requests_per_minute": 0}})


def test_anonymous_tier_must_exist(monkeypatch):
    monkeypatch.setenv("CONVEYOR_GATEWAY_ANONYMOUS_TIER", "gold")
    with pytest.raises(ValueError, match="CONVEYOR_GATEWAY_ANONYMOUS_TIER"):
        TenancySettings()


def test_request_priority_can_only_lower_its_own_within_the_tier():
    standard = DEFAULT_TIERS["standard"]
    assert engine_priority(standard) == 10
    assert engine_priority(standard, 0) == 10
    assert engine_priority(standard, 9) == 19
    for requested in (-1, 10):
        with pytest.raises(PriorityNotAllowed) as refused:
            engine_priority(standard, requested)
        assert refused.value.status_code == 400
        assert refused.value.body()["error"]["param"] == "priority"


def test_premium_runs_ahead_of_batch_whatever_batch_asks():
    lowest_premium = engine_priority(DEFAULT_TIERS["premium"], 9)
    assert lowest_premium < engine_priority(DEFAULT_TIERS["batch"], 0)


def test_each_tenant_has_its_own_cache_salt_unless_its_tier_shares():
    standard = DEFAULT_TIERS["standard"]
    assert Tenant("acme", standard).cache_salt != Tenant("globex", standard).cache_salt
    shared = build_tiers({"standard": {"cache_sharing": "global"}})["standard"]
    assert Tenant("acme", shared).cache_salt == Tenant("globex", shared).cache_salt == ""


def test_error_bodies_have_openai_shape():
    assert openai_error_body("m", "invalid_request_error", "invalid_api_key") == {
        "error": {"message": "m", "type": "invalid_request_error", "param": None,
                  "code": "invalid_api_key"}}
    limited = RateLimited("slow down", "requests", 0.2)
    assert limited.headers() == {"Retry-After": "1"}
    assert limited.body()["error"]["type"] == "rate_limit_exceeded"


@pytest.mark.parametrize(("seconds", "text"), [
    (0.25, "250ms"), (0, "0ms"), (1, "1s"), (1.5, "1.5s"), (12, "12s"), (360, "6m0s"),
    (3723, "1h2m3s"),
])
def test_durations_are_written_like_openai_reset_headers(seconds, text):
    assert format_duration(seconds) == text


def test_unlimited_limits_send_no_headers():
    quota = QuotaSnapshot(None, None, 0, 1000, 400, 36.0, 1)
    assert quota.headers() == {"x-ratelimit-limit-tokens": "1000",
                               "x-ratelimit-remaining-tokens": "400",
                               "x-ratelimit-reset-tokens": "36s"}
