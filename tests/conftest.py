"""End-to-end fixtures: the real tokenizer, engine, detok and gateway processes
(started once per session, ports picked by the OS), the real bundled model and
the real Redis at 127.0.0.1:6379."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from conveyor.common.testing import ServiceProcess

REDIS_URL = os.environ.get("CONVEYOR_REDIS_URL", "redis://127.0.0.1:6379/0")
MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 2048
"""A small context keeps the engine's KV pool (and start-up) small on the CPU."""


@dataclass
class Stack:
    """The running pipeline: one process per service."""

    tokenizer: ServiceProcess
    engine: ServiceProcess
    detok: ServiceProcess
    gateway: ServiceProcess

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    def gateway_env(self, **overrides: str) -> dict[str, str]:
        """The gateway's environment for this stack (overrides win)."""
        return gateway_env(self.tokenizer, self.engine, self.detok, **overrides)


def gateway_env(tokenizer: ServiceProcess, engine: ServiceProcess, detok: ServiceProcess,
                **overrides: str) -> dict[str, str]:
    return {
        "CONVEYOR_GATEWAY_PORT": "0",
        "CONVEYOR_GATEWAY_TOKENIZER_ADDRESS": tokenizer.address,
        "CONVEYOR_GATEWAY_ENGINE_ADDRESSES": engine.address,
        "CONVEYOR_GATEWAY_DETOK_ADDRESS": detok.address,
        "CONVEYOR_GATEWAY_REQUEST_TIMEOUT_S": "120",
        **overrides,
    }


def _require_redis() -> None:
    from redis import Redis

    try:
        Redis.from_url(REDIS_URL, socket_timeout=2).ping()
    except Exception as exc:  # noqa: BLE001 - any failure means no Redis to test against
        pytest.fail(f"no Redis at {REDIS_URL} ({exc}); start one with `make redis`")


def _require_services() -> None:
    missing = [name for name in ("tokenizer", "engine", "detok", "gateway")
               if importlib.util.find_spec(f"conveyor.{name}.__main__") is None]
    if missing:
        pytest.skip(f"not built yet: {', '.join(missing)}")


def _model_service(service: str, log_dir: Path, name: str | None = None) -> ServiceProcess:
    settings = {"MODEL": MODEL, "MAX_MODEL_LEN": str(MAX_MODEL_LEN), "PORT": "0"}
    return ServiceProcess(
        f"conveyor.{service}", name=name or service, log_path=log_dir / f"{name or service}.log",
        env={"HF_HUB_OFFLINE": "1",
             **{f"CONVEYOR_{service.upper()}_{k}": v for k, v in settings.items()}},
    )


def _model_services(log_dir: Path) -> list[ServiceProcess]:
    return [_model_service(name, log_dir) for name in ("tokenizer", "engine", "detok")]


def start_gateway(env: dict[str, str], log_dir: Path, name: str = "gateway") -> ServiceProcess:
    return ServiceProcess("conveyor.gateway", env=env, name=name,
                          log_path=log_dir / f"{name}.log").start(timeout_s=60)


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e-logs")


@pytest.fixture(scope="session")
def stack(log_dir) -> Stack:
    """All four services, started once; the model services start in parallel."""
    _require_services()
    _require_redis()
    processes = _model_services(log_dir)
    try:
        with ThreadPoolExecutor(len(processes)) as pool:
            list(pool.map(lambda p: p.start(timeout_s=600), processes))
        tokenizer, engine, detok = processes
        gateway = start_gateway(gateway_env(tokenizer, engine, detok), log_dir)
    except BaseException:
        for process in processes:
            process.stop()
        raise
    stack = Stack(tokenizer, engine, detok, gateway)
    yield stack
    for process in (gateway, *processes):
        process.stop()


@pytest.fixture
def openai_client(stack):
    import openai

    return openai.OpenAI(base_url=stack.api_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def async_openai(stack):
    import openai

    return openai.AsyncOpenAI(base_url=stack.api_url, api_key="unused", max_retries=0,
                              timeout=300)


@pytest.fixture
async def engine_client(stack):
    """The gateway's own client of the engine, for Stats."""
    from conveyor.common.grpc_client import open_channel
    from conveyor.gateway.engine_client import EngineClient

    channel = open_channel(stack.engine.address)
    yield EngineClient(stack.engine.address, channel, rpc_timeout_s=5)
    await channel.close()


async def wait_for_idle_engine(engine_client, timeout_s: float = 1.0):
    """Poll Stats until no request runs or waits and every KV block is free; the
    last Stats either way."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        stats = await engine_client.stats()
        idle = (stats.num_running == 0 and stats.num_waiting == 0
                and stats.num_free_blocks == stats.num_blocks)
        if idle or loop.time() > deadline:
            return stats
        await asyncio.sleep(0.02)


@pytest.fixture
def idle_engine(engine_client):
    """`await idle_engine(timeout_s)`: the engine's Stats once it is idle (or at timeout)."""
    return lambda timeout_s=1.0: wait_for_idle_engine(engine_client, timeout_s)


@pytest.fixture
def extra_gateway(stack, log_dir):
    """`extra_gateway(**env_overrides)` starts another gateway process for one test."""
    started: list[ServiceProcess] = []

    def start(**overrides: str) -> ServiceProcess:
        name = f"gateway-extra-{len(started)}"
        started.append(start_gateway(stack.gateway_env(**overrides), log_dir, name))
        return started[-1]

    yield start
    for process in started:
        process.stop()


@pytest.fixture
def spare_detok(stack, log_dir):
    """A detok process of this test's own (to kill mid-request)."""
    process = _model_service("detok", log_dir, name="detok-spare").start(timeout_s=120)
    yield process
    process.stop()
