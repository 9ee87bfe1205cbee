"""End-to-end fixtures: the real tokenizer, engine, detok and gateway processes
(started once per session by devkit's stack launcher, ports picked by the OS), the real
bundled model and the real Redis at CONVEYOR_REDIS_URL (default 127.0.0.1:6379)."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from pathlib import Path

import pytest

from devkit.local_redis import delete_namespace, redis_url
from devkit.service_process import ServiceProcess, start_all
from devkit.stack import PIPELINE, Stack, StackSpec, installed

REDIS_URL = redis_url()
REDIS_PREFIX = f"e2e:{uuid.uuid4().hex[:12]}"
"""This session's Redis namespace (keys, quotas, bindings, timelines), deleted at the end."""
ENGINE_SETTINGS = {"DTYPE": "float32", "MAX_MODEL_LEN": "2048", "TORCH_THREADS": "1"}
"""MAX_MODEL_LEN: the engine's is the only setting of it (the gateway and tokenizer use the
value it publishes); a small context keeps the engine's KV pool (and start-up) small on the
CPU. float32: the tests compare greedy output across runs and batches, which float32 keeps
equal; dtype auto is bfloat16 on a CPU with AMX or AVX512-BF16, whose greedy output moves
with the batch a request shares (docs/performance.md, bf16). One torch thread: the test
clients and the other services share the cores with the engine, whichever of them is busy
when it starts."""


def stack_spec(log_dir: Path) -> StackSpec:
    """The session's stack: the bundled model, the gateways' keys in this session's
    namespace. Its replicas register nowhere, so a gateway given other addresses (a proxy,
    a dead port) or another namespace sees only those."""
    return StackSpec(log_dir, engine=ENGINE_SETTINGS, gateway={"REQUEST_TIMEOUT_S": "120"},
                     env={"HF_HUB_OFFLINE": "1"}, redis_url=REDIS_URL,
                     redis_prefix=REDIS_PREFIX, register_replicas=False)


def _require_redis() -> None:
    from redis import Redis

    try:
        Redis.from_url(REDIS_URL, socket_timeout=2).ping()
    except Exception as exc:  # noqa: BLE001 - any failure means no Redis to test against
        pytest.fail(f"no Redis at {REDIS_URL} ({exc}); start one with `make redis`")


def _require_services() -> None:
    missing = [name for name in PIPELINE if not installed(name)]
    if missing:
        pytest.skip(f"not built yet: {', '.join(missing)}")


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e-logs")


@pytest.fixture(scope="session")
def stack(log_dir) -> Stack:
    """All four services, started once (devkit/stack.py)."""
    _require_services()
    _require_redis()
    with Stack(stack_spec(log_dir)) as running:
        yield running
    delete_namespace(REDIS_URL, REDIS_PREFIX)


class Launcher:
    """Starts more gateway and engine processes next to the stack; `stop_all` ends them."""

    def __init__(self, stack: Stack):
        self._stack = stack
        self.started: list[ServiceProcess] = []

    def gateway(self, name: str, **env_overrides: str) -> ServiceProcess:
        """A gateway with the stack's environment (overrides win)."""
        process = self._stack.process("gateway", name, env=env_overrides).start(timeout_s=60)
        self.started.append(process)
        return process

    def engines(self, *names: str, **settings: str) -> list[ServiceProcess]:
        """Small engine processes (started in parallel), each with its name as engine id;
        `settings` by field name, e.g. MAX_NUM_SEQS="2". Engines register in a Redis
        namespace no gateway reads unless REDIS_PREFIX names the gateways' one."""
        settings = {"MAX_MODEL_LEN": "512", "KV_CACHE_GIB": "0.1", "REDIS_URL": REDIS_URL,
                    "REDIS_PREFIX": f"{REDIS_PREFIX}:unseen", **settings}
        processes = [self._stack.process("engine", name, ENGINE_ID=name, **settings)
                     for name in names]
        start_all(processes)
        self.started += processes
        return processes

    def stop_all(self) -> None:
        for process in reversed(self.started):
            process.stop()


@pytest.fixture
def launch(stack):
    """A Launcher whose processes stop when the test ends."""
    launcher = Launcher(stack)
    yield launcher
    launcher.stop_all()


@pytest.fixture(scope="module")
def module_launch(stack):
    """A Launcher whose processes stop when the module's tests are done."""
    launcher = Launcher(stack)
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

    address = stack.processes["engine"].address
    channel = open_channel(address)
    yield EngineClient(address, channel, rpc_timeout_s=5)
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
def extra_gateway(launch):
    """`extra_gateway(**env_overrides)` starts another gateway process for one test."""
    numbers = itertools.count()
    return lambda **overrides: launch.gateway(f"gateway-extra-{next(numbers)}", **overrides)


@pytest.fixture
def spare_detok(stack):
    """A detok process of this test's own (to kill mid-request)."""
    process = stack.process("detok", "detok-spare").start(timeout_s=120)
    yield process
    process.stop()
