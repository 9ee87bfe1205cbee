"""End-to-end fixtures: the real tokenizer, engine, detok and gateway processes
(started once per session, ports picked by the OS), the real bundled model and
the real Redis at 127.0.0.1:6379."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from devkit.service_process import ServiceProcess

REDIS_URL = os.environ.get("CONVEYOR_REDIS_URL", "redis://127.0.0.1:6379/0")
MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 2048
"""A small context keeps the engine's KV pool (and start-up) small on the CPU."""
REDIS_PREFIX = f"e2e:{uuid.uuid4().hex[:12]}"
"""This session's Redis namespace (keys, quotas, bindings, timelines), deleted at the end."""


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

    @property
    def redis_url(self) -> str:
        return REDIS_URL

    @property
    def redis_prefix(self) -> str:
        """The Redis namespace of this session's gateways (deleted at the end)."""
        return REDIS_PREFIX

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
        "CONVEYOR_GATEWAY_REDIS_URL": REDIS_URL,
        "CONVEYOR_GATEWAY_REDIS_PREFIX": REDIS_PREFIX,
        "CONVEYOR_GATEWAY_AUTH_ENABLED": "false",
        **overrides,
    }


def _require_redis() -> None:
    from redis import Redis

    try:
        Redis.from_url(REDIS_URL, socket_timeout=2).ping()
    except Exception as exc:  # noqa: BLE001 - any failure means no Redis to test against
        pytest.fail(f"no Redis at {REDIS_URL} ({exc}); start one with `make redis`")


def _delete_namespace(prefix: str) -> None:
    from redis import Redis

    client = Redis.from_url(REDIS_URL, socket_timeout=2)
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def _require_services() -> None:
    missing = [name for name in ("tokenizer", "engine", "detok", "gateway")
               if importlib.util.find_spec(f"conveyor.{name}.__main__") is None]
    if missing:
        pytest.skip(f"not built yet: {', '.join(missing)}")


ENGINE_DEFAULTS = {"DTYPE": "float32", "MAX_MODEL_LEN": str(MAX_MODEL_LEN)}
"""MAX_MODEL_LEN: the engine's is the only setting of it (the gateway and tokenizer use the
value it publishes). float32: the tests compare greedy output across runs and batches, which
float32 keeps equal; dtype auto is bfloat16 on a CPU with AMX or AVX512-BF16, whose greedy
output moves with the batch a request shares (docs/performance.md, bf16)."""


def _model_service(service: str, log_dir: Path, name: str | None = None,
                   **settings_overrides: str) -> ServiceProcess:
    """A tokenizer/engine/detok process; `settings_overrides` are its settings by field
    name (MAX_NUM_SEQS="2" becomes CONVEYOR_ENGINE_MAX_NUM_SEQS=2)."""
    settings = {"MODEL": MODEL, "PORT": "0", **(ENGINE_DEFAULTS if service == "engine" else {}),
                **settings_overrides}
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
    _delete_namespace(REDIS_PREFIX)


class Launcher:
    """Starts more gateway and engine processes next to the stack; `stop_all` ends them."""

    def __init__(self, stack: Stack, log_dir: Path):
        self._stack = stack
        self._log_dir = log_dir
        self.started: list[ServiceProcess] = []

    def gateway(self, name: str, **env_overrides: str) -> ServiceProcess:
        """A gateway with the stack's environment (overrides win)."""
        return self._keep(start_gateway(self._stack.gateway_env(**env_overrides),
                                        self._log_dir, name))

    def engines(self, *names: str, **settings: str) -> list[ServiceProcess]:
        """Small engine processes (started in parallel), each with its name as engine id;
        `settings` by field name, e.g. MAX_NUM_SEQS="2". Engines register in a Redis
        namespace no gateway reads unless REDIS_PREFIX names the gateways' one."""
        settings = {"MAX_MODEL_LEN": "512", "KV_CACHE_GIB": "0.1", "REDIS_URL": REDIS_URL,
                    "REDIS_PREFIX": f"{REDIS_PREFIX}:unseen", **settings}
        processes = [_model_service("engine", self._log_dir, name=name, ENGINE_ID=name,
                                    **settings) for name in names]
        with ThreadPoolExecutor(len(processes)) as pool:
            results = list(pool.map(self._start_engine, processes))
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return processes

    def _start_engine(self, process: ServiceProcess) -> ServiceProcess | BaseException:
        try:
            return self._keep(process.start(timeout_s=600))
        except BaseException as exc:  # noqa: BLE001 - re-raised by engines() after the others
            return exc

    def _keep(self, process: ServiceProcess) -> ServiceProcess:
        self.started.append(process)
        return process

    def stop_all(self) -> None:
        for process in reversed(self.started):
            process.stop()


@pytest.fixture
def launch(stack, log_dir):
    """A Launcher whose processes stop when the test ends."""
    launcher = Launcher(stack, log_dir)
    yield launcher
    launcher.stop_all()


@pytest.fixture(scope="module")
def module_launch(stack, log_dir):
    """A Launcher whose processes stop when the module's tests are done."""
    launcher = Launcher(stack, log_dir)
    yield launcher
    launcher.stop_all()


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
    from conveyor.gateway.clients.engine import EngineClient

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
