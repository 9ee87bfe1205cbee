"""`python -m conveyor.gateway.tenancy`: create, list and revoke API keys, show tiers.

    python -m conveyor.gateway.tenancy create --tenant acme --tier premium
    python -m conveyor.gateway.tenancy create --tenant ops --tier premium --admin
    python -m conveyor.gateway.tenancy list
    python -m conveyor.gateway.tenancy revoke KEY_ID
    python -m conveyor.gateway.tenancy tiers

Redis and the tiers come from the gateway's settings (CONVEYOR_GATEWAY_REDIS_URL,
CONVEYOR_GATEWAY_REDIS_PREFIX, CONVEYOR_GATEWAY_TIERS).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError

from conveyor.gateway.tenancy.api_keys import ApiKeyStore
from conveyor.gateway.tenancy.settings import TenancySettings


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(prog="python -m conveyor.gateway.tenancy",
                                  description="Manage Conveyor API keys.")
    commands = cli.add_subparsers(dest="command", required=True)
    create = commands.add_parser("create", help="create a key; it is printed once")
    create.add_argument("--tenant", required=True, help="tenant id (letters, digits, _ . -)")
    create.add_argument("--tier", required=True, help="tier name (see `tiers`)")
    create.add_argument("--admin", action="store_true",
                        help="an admin's key: may also load and unload LoRA adapters")
    commands.add_parser("list", help="list keys (ids, tenants, tiers; never the keys)")
    revoke = commands.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id")
    commands.add_parser("tiers", help="show the tiers and their limits")
    return cli


async def run(args: argparse.Namespace, settings: TenancySettings) -> int:
    if args.command == "tiers":
        return print_tiers(settings)
    redis = Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        store = ApiKeyStore(redis, settings.tier_table, prefix=settings.redis_prefix)
        return await _run_key_command(store, args)
    finally:
        await redis.aclose()


async def _run_key_command(store: ApiKeyStore, args: argparse.Namespace) -> int:
    if args.command == "create":
        created = await store.create(args.tenant, args.tier, admin=args.admin)
        print(f"key_id: {created.record.key_id}", file=sys.stderr)
        print("Store this key now; it cannot be shown again:", file=sys.stderr)
        print(created.key)
        return 0
    if args.command == "list":
        for record in await store.list():
            created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created_at))
            print(f"{record.key_id}  {record.tenant_id}  {record.tier}  {created}  "
                  f"{record.redacted}{'  admin' if record.admin else ''}")
        return 0
    if await store.revoke(args.key_id):
        print(f"revoked {args.key_id}")
        return 0
    print(f"no key with id {args.key_id!r} (see `list`)", file=sys.stderr)
    return 1


def print_tiers(settings: TenancySettings) -> int:
    for tier in settings.tier_table.values():
        print(f"{tier.name}: priority {tier.priority} (+0..{tier.max_priority_offset}), "
              f"rpm {_limit(tier.requests_per_minute)}, tpm {_limit(tier.tokens_per_minute)}, "
              f"concurrent {_limit(tier.max_concurrent_requests)}, "
              f"prefix cache per {tier.cache_sharing.value}")
    return 0


def _limit(value: int | None) -> str:
    return "unlimited" if value is None else str(value)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return asyncio.run(run(args, TenancySettings()))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RedisError as exc:
        print(f"error: Redis at CONVEYOR_GATEWAY_REDIS_URL: {exc}", file=sys.stderr)
        return 2
