"""Unit-test fixtures: fake gRPC services and an in-process gateway on a real port."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
from redis import Redis as SyncRedis

from conveyor.gateway.app import create_app
from conveyor.gateway.settings import GatewaySettings
from conveyor.gateway.tenancy.api_keys import ApiKeyStore
from conveyor.gateway.tenancy.tiers import DEFAULT_TIERS


def _load_fakes():
    """fakes.py by path (the tests folder is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "conveyor_gateway_test_fakes", Path(__file__).with_name("fakes.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


fakes_module = _load_fakes()
FakeServices, start_fakes = fakes_module.FakeServices, fakes_module.start_fakes


@dataclass
class Gateway:
    url: str
    app: object
    fakes: FakeServices

    @property
    def pipeline(self):
        return self.app.state.pipeline

    def client(self, **kwargs) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=10, **kwargs)


@pytest.fixture
async def fakes():
    services = await start_fakes()
    yield services
    await services.stop()


async def _serve(settings: GatewaySettings):
    app = create_app(settings)
    # A bounded shutdown: test_swallowed_cancellation left, once in ~13 runs under load, a
    # request task that never ended after its checks passed, and teardown waited forever.
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None,
                                           lifespan="on", timeout_graceful_shutdown=10))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return app, server, task


@pytest.fixture
async def gateway_factory(fakes, redis_url, prefix):
    """Gateways over the fakes and the real Redis (in the test's namespace `prefix`);
    auth off unless overridden."""
    started = []

    async def start(**overrides) -> Gateway:
        settings = GatewaySettings(**{
            "port": 0, "tokenizer_address": fakes.address("tokenizer"),
            "engine_addresses": fakes.address("engine"), "detok_address": fakes.address("detok"),
            "redis_url": redis_url, "redis_prefix": prefix, "auth_enabled": False,
            **overrides,
        })
        app, server, task = await _serve(settings)
        started.append((server, task))
        port = server.servers[0].sockets[0].getsockname()[1]
        return Gateway(f"http://127.0.0.1:{port}", app, fakes)

    yield start
    for server, task in started:
        server.should_exit = True
        await task


@pytest.fixture
async def gateway(gateway_factory) -> Gateway:
    return await gateway_factory()


@pytest.fixture
async def two_tenants(gateway_factory, redis, prefix) -> tuple[Gateway, str, str]:
    """A gateway with API keys on, and the keys of two tenants: an owner and another."""
    gateway = await gateway_factory(auth_enabled=True)
    keys = ApiKeyStore(redis, DEFAULT_TIERS, prefix=prefix)
    return (gateway, (await keys.create("owner", "standard")).key,
            (await keys.create("other", "standard")).key)


async def _wait_until(condition, timeout_s: float = 1.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.fixture
def wait_until():
    """`await wait_until(condition, timeout_s=1.0)`: fails when it stays false that long."""
    return _wait_until


class ThreadedGateway:
    """The fakes and a gateway over them, served by an event loop on a thread of their
    own, so synchronous tests (hypothesis, schemathesis) can call them over HTTP."""

    def __init__(self, redis_url: str, **overrides):
        self.prefix = f"test:{uuid.uuid4().hex}"
        self._redis_url = redis_url
        self._overrides = overrides
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    def __enter__(self) -> Gateway:
        self._thread.start()
        return self._ready.result(timeout=30)

    def __exit__(self, *exc_info) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        client = SyncRedis.from_url(self._redis_url)
        keys = list(client.scan_iter(match=f"{self.prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()

    async def _serve(self) -> None:
        fakes = await start_fakes()
        settings = GatewaySettings(**{
            "port": 0, "tokenizer_address": fakes.address("tokenizer"),
            "engine_addresses": fakes.address("engine"), "detok_address": fakes.address("detok"),
            "redis_url": self._redis_url, "redis_prefix": self.prefix, "auth_enabled": False,
            **self._overrides})
        app, self._server, task = await _serve(settings)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self._ready.set_result(Gateway(f"http://127.0.0.1:{port}", app, fakes))
        await task
        await fakes.stop()


@pytest.fixture(scope="module")
def threaded_gateway(redis_url):
    """A ThreadedGateway for the module's synchronous tests (auth off)."""
    with ThreadedGateway(redis_url) as served:
        yield served
