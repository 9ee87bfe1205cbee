"""Fixtures: the real Redis at CONVEYOR_REDIS_URL and a fresh key namespace per test."""

from __future__ import annotations

import os
import uuid

import pytest
from redis.asyncio import Redis

REDIS_URL = os.environ.get("CONVEYOR_REDIS_URL", "redis://127.0.0.1:6379/0")


async def connect() -> Redis:
    client = Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        await client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means no Redis to test against
        pytest.fail(f"no Redis at {REDIS_URL} ({exc}); start one with `make redis`")
    return client


@pytest.fixture
async def redis():
    client = await connect()
    yield client
    await client.aclose()


@pytest.fixture
async def other_redis():
    """A second, independent client: another gateway replica."""
    client = await connect()
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(redis):
    namespace = f"test:{uuid.uuid4().hex}"
    yield namespace
    keys = [key async for key in redis.scan_iter(match=f"{namespace}:*")]
    if keys:
        await redis.delete(*keys)
