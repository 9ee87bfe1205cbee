"""API keys against the real Redis: stored hashed, checked in constant time, revocable; the CLI."""

from __future__ import annotations

import asyncio

import pytest

from conveyor.gateway.tenancy import api_keys
from conveyor.gateway.tenancy.api_keys import ApiKeyStore, bearer_key, key_digest
from conveyor.gateway.tenancy.cli import main
from conveyor.gateway.tenancy.errors import InvalidApiKey, MissingApiKey, TierNotConfigured
from conveyor.gateway.tenancy.tiers import DEFAULT_TIERS


@pytest.fixture
def store(redis, prefix):
    return ApiKeyStore(redis, DEFAULT_TIERS, prefix=prefix)


async def test_a_created_key_authenticates_as_its_tenant_and_tier(store):
    created = await store.create("acme", "premium")
    tenant = await store.authenticate(created.key)
    assert (tenant.tenant_id, tenant.tier.name, tenant.key_id) == \
        ("acme", "premium", created.record.key_id)
    assert created.key.startswith("cvy-") and len(created.key) > 40


async def test_only_the_digest_is_stored_never_the_key(redis, prefix, store):
    created = await store.create("acme", "standard")
    stored = []
    async for key in redis.scan_iter(match=f"{prefix}:*"):
        value = await redis.hgetall(key) if await redis.type(key) == "hash" \
            else await redis.smembers(key)
        stored.append(f"{key} {value}")
    assert created.key not in " ".join(stored)
    assert key_digest(created.key) in " ".join(stored)


async def test_wrong_and_revoked_keys_fail(store):
    created = await store.create("acme", "standard")
    with pytest.raises(InvalidApiKey):
        await store.authenticate(created.key + "x")
    assert await store.revoke(created.record.key_id) is True
    with pytest.raises(InvalidApiKey) as refused:
        await store.authenticate(created.key)
    assert refused.value.status_code == 401
    assert refused.value.body()["error"]["type"] == "invalid_request_error"
    assert refused.value.body()["error"]["code"] == "invalid_api_key"
    assert created.key not in refused.value.message
    assert await store.revoke(created.record.key_id) is False


async def test_the_digest_is_compared_in_constant_time(store, monkeypatch):
    compared = []

    def spy(a, b):
        compared.append((a, b))
        return a == b

    created = await store.create("acme", "standard")
    monkeypatch.setattr(api_keys.hmac, "compare_digest", spy)
    await store.authenticate(created.key)
    assert compared == [(key_digest(created.key), key_digest(created.key))]


async def test_list_shows_ids_tenants_and_tiers(store):
    first = await store.create("acme", "premium")
    second = await store.create("globex", "free")
    await store.create("initech", "batch")
    await store.revoke(second.record.key_id)
    listed = await store.list()
    assert [(r.tenant_id, r.tier) for r in listed] == [("acme", "premium"), ("initech", "batch")]
    assert listed[0] == first.record


async def test_create_refuses_unknown_tiers_and_bad_tenant_ids(store):
    with pytest.raises(ValueError, match="unknown tier 'gold'"):
        await store.create("acme", "gold")
    with pytest.raises(ValueError, match="tenant id"):
        await store.create("acme corp", "free")


async def test_key_of_a_tier_no_longer_configured_is_a_server_error(redis, prefix, store):
    created = await store.create("acme", "batch")
    without_batch = {n: t for n, t in DEFAULT_TIERS.items() if n != "batch"}
    with pytest.raises(TierNotConfigured) as refused:
        await ApiKeyStore(redis, without_batch, prefix=prefix).authenticate(created.key)
    assert refused.value.status_code == 500


def test_bearer_key_reads_the_authorization_header():
    assert bearer_key("Bearer cvy-abc") == "cvy-abc"
    assert bearer_key("bearer  cvy-abc ") == "cvy-abc"
    for header in (None, "", "Bearer", "Basic cvy-abc"):
        with pytest.raises(MissingApiKey) as missing:
            bearer_key(header)
        assert missing.value.status_code == 401


async def test_cli_creates_lists_and_revokes(redis, prefix, monkeypatch, capsys):
    monkeypatch.setenv("CONVEYOR_GATEWAY_REDIS_PREFIX", prefix)
    assert await asyncio.to_thread(main, ["create", "--tenant", "acme", "--tier", "premium"]) == 0
    key = capsys.readouterr().out.strip()
    assert (await ApiKeyStore(redis, DEFAULT_TIERS, prefix=prefix).authenticate(key)).tenant_id \
        == "acme"
    assert await asyncio.to_thread(main, ["list"]) == 0
    listing = capsys.readouterr().out
    assert "acme" in listing and "premium" in listing and key not in listing
    key_id = listing.split()[0]
    assert await asyncio.to_thread(main, ["revoke", key_id]) == 0
    assert await asyncio.to_thread(main, ["revoke", key_id]) == 1
    assert await asyncio.to_thread(main, ["create", "--tenant", "acme", "--tier", "gold"]) == 2


async def test_cli_admin_flag_makes_an_admins_key_and_list_shows_it(redis, prefix, monkeypatch,
                                                                    capsys):
    monkeypatch.setenv("CONVEYOR_GATEWAY_REDIS_PREFIX", prefix)
    store = ApiKeyStore(redis, DEFAULT_TIERS, prefix=prefix)
    assert await asyncio.to_thread(main, ["create", "--tenant", "ops", "--tier", "premium",
                                          "--admin"]) == 0
    admin = capsys.readouterr().out.strip()
    plain = (await store.create("acme", "premium")).key
    assert (await store.authenticate(admin)).is_admin
    assert not (await store.authenticate(plain)).is_admin
    assert await asyncio.to_thread(main, ["list"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [row.endswith("admin") for row in sorted(rows, key=lambda r: "ops" in r)] == \
        [False, True]
    assert [r.admin for r in await store.list()] == [True, False]


async def test_a_key_found_valid_is_trusted_for_the_cache_ttl_without_reading_redis(
        redis, prefix, monkeypatch):
    gateway = ApiKeyStore(redis, DEFAULT_TIERS, prefix=prefix, cache_ttl_s=60)
    created = await gateway.create("acme", "standard")
    assert (await gateway.authenticate(created.key)).tenant_id == "acme"
    reads, hgetall = [], redis.hgetall

    async def counted_hgetall(name):
        reads.append(name)
        return await hgetall(name)

    monkeypatch.setattr(redis, "hgetall", counted_hgetall)
    assert (await gateway.authenticate(created.key)).tenant_id == "acme"
    assert reads == []
    with pytest.raises(InvalidApiKey):  # another key is read (and refused)
        await gateway.authenticate(created.key + "x")
    assert len(reads) == 1


async def test_a_key_revoked_on_another_replica_stops_working_here_within_the_ttl(
        redis, other_redis, prefix):
    here = ApiKeyStore(redis, DEFAULT_TIERS, prefix=prefix, cache_ttl_s=0.3)
    elsewhere = ApiKeyStore(other_redis, DEFAULT_TIERS, prefix=prefix)
    created = await here.create("acme", "standard")
    await here.authenticate(created.key)
    await elsewhere.revoke(created.record.key_id)
    revoked_at = asyncio.get_running_loop().time()
    await here.authenticate(created.key)  # still trusted: inside the TTL
    with pytest.raises(InvalidApiKey):  # the replica that revokes forgets it at once
        await elsewhere.authenticate(created.key)
    while True:
        try:
            await here.authenticate(created.key)
        except InvalidApiKey:
            break
        assert asyncio.get_running_loop().time() - revoked_at < 0.3 + 0.2, "still valid"
        await asyncio.sleep(0.02)
    assert asyncio.get_running_loop().time() - revoked_at >= 0.25
