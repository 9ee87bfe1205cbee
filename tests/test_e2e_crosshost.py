"""Across hosts: every service in its own Linux network namespace with its own address,
found through the production discovery (the Redis registry; no static address list).

The test makes a bridge and one namespace per process (Redis, the gateway, and
tokenizer, detok and engine replicas), each joined to the bridge by a veth pair
with an address of 10.231.N.0/24; nothing else may receive traffic. It shows:

- engines register addresses the gateway reaches (their 10.231 addresses);
- every replica of every service gets traffic (2 tokenizers, 2 detoks, 2 engines);
- a third replica of each, started mid-run, gets traffic;
- with one replica of each service killed, no request that arrives afterwards is lost.

It prints the per-replica request counts: engines from the gateway's
x-conveyor-engine header, tokenizer and detok replicas from the gateway's
conveyor_gateway_replica_calls_total. Skipped where namespaces cannot be made.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from conveyor.common.engine_registry import EngineRegistry
from conveyor.common.service_registry import ReplicaEntry, ServiceRegistry
from devkit import replica_processes as rp
from devkit.service_process import ServiceProcess, start_all

pytestmark = pytest.mark.slow

PREFIX = "crosshost"
MAX_MODEL_LEN = "512"
GATEWAY_PORT = 8000
REDIS_PORT = 6379
ENGINE_SETTINGS = {"MAX_MODEL_LEN": MAX_MODEL_LEN, "KV_CACHE_GIB": "0.1",
                   "TORCH_THREADS": "1", "PORT": "50052"}


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Network:
    """A bridge on 10.231.N.0/24 (the test's side is .1) and the namespaces on it."""

    tag: str = field(default_factory=lambda: f"{random.randrange(16**4):04x}")
    octet: int = field(default_factory=lambda: random.randrange(1, 255))
    namespaces: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"cvbr{self.tag}"

    def address(self, index: int) -> str:
        return f"10.231.{self.octet}.{index}"

    def create(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.address(1)}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")

    def host(self, name: str) -> tuple[str, str]:
        """A namespace joined to the bridge: (namespace, its address)."""
        index = len(self.namespaces) + 2
        namespace, outside = f"cv{self.tag}-{name}", f"cv{self.tag}v{index}"
        _run("ip", "netns", "add", namespace)
        self.namespaces.append(namespace)
        _run("ip", "link", "add", outside, "type", "veth", "peer", "name", f"{outside}p")
        _run("ip", "link", "set", f"{outside}p", "netns", namespace)
        _run("ip", "link", "set", outside, "master", self.bridge, "up")
        _run("ip", "-n", namespace, "link", "set", f"{outside}p", "name", "eth0")
        _run("ip", "-n", namespace, "addr", "add", f"{self.address(index)}/24", "dev", "eth0")
        _run("ip", "-n", namespace, "link", "set", "eth0", "up")
        _run("ip", "-n", namespace, "link", "set", "lo", "up")
        return namespace, self.address(index)

    def remove(self) -> None:
        for namespace in self.namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)


def _namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces (ip netns)"
    if shutil.which("ip") is None or shutil.which("redis-server") is None:
        return "needs iproute2 (ip) and redis-server on PATH"
    probe = f"cvprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Cluster:
    """The processes of the cross-host deployment, one namespace each."""

    def __init__(self, network: Network, log_dir: Path):
        self.network = network
        self.log_dir = log_dir
        self.processes: dict[str, ServiceProcess] = {}
        self.addresses: dict[str, str] = {}
        self.redis_process: subprocess.Popen | None = None

    @property
    def redis_url(self) -> str:
        return f"redis://{self.addresses['redis']}:{REDIS_PORT}/0"

    @property
    def gateway_url(self) -> str:
        return f"http://{self.addresses['gateway']}:{GATEWAY_PORT}"

    def start_redis(self) -> None:
        namespace, address = self.network.host("redis")
        self.addresses["redis"] = address
        self.redis_process = subprocess.Popen(
            ["ip", "netns", "exec", namespace, "redis-server", "--bind", address, "--port",
             str(REDIS_PORT), "--save", "", "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_for_redis()

    def _wait_for_redis(self, timeout_s: float = 20.0) -> None:
        from redis import Redis as SyncRedis
        from redis.exceptions import ConnectionError as RedisConnectionError

        deadline = time.monotonic() + timeout_s
        client = SyncRedis.from_url(self.redis_url, socket_timeout=1)
        while True:
            try:
                client.ping()
                break
            except RedisConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        client.close()

    def replica(self, service: str, name: str, **settings: str) -> ServiceProcess:
        """A tokenizer/detok/engine process in namespace `name`, bound to its address."""
        namespace, address = self.network.host(name)
        self.addresses[name] = address
        process = rp.replica_process(service, name, self.log_dir, self.redis_url, PREFIX,
                                     argv_prefix=("ip", "netns", "exec", namespace),
                                     HOST=address, **settings)
        self.processes[name] = process
        return process

    def replicas(self, suffix: str) -> list[ServiceProcess]:
        """One tokenizer, detok and engine, named tokenizer-<suffix> and so on."""
        return [self.replica("tokenizer", f"tokenizer-{suffix}", PORT="50051"),
                self.replica("detok", f"detok-{suffix}", PORT="50053"),
                self.replica("engine", f"engine-{suffix}", ENGINE_ID=f"engine-{suffix}",
                             **ENGINE_SETTINGS)]

    def gateway(self) -> ServiceProcess:
        namespace, address = self.network.host("gateway")
        self.addresses["gateway"] = address
        env = {"CONVEYOR_GATEWAY_HOST": address, "CONVEYOR_GATEWAY_PORT": str(GATEWAY_PORT),
               "CONVEYOR_GATEWAY_REDIS_URL": self.redis_url,
               "CONVEYOR_GATEWAY_REDIS_PREFIX": PREFIX,
               "CONVEYOR_GATEWAY_ENGINE_ADDRESSES": "", "CONVEYOR_GATEWAY_TOKENIZER_ADDRESS": "",
               "CONVEYOR_GATEWAY_DETOK_ADDRESS": "", "CONVEYOR_GATEWAY_AUTH_ENABLED": "false",
               "CONVEYOR_GATEWAY_REPLICA_REFRESH_S": "0.5",
               "CONVEYOR_GATEWAY_REQUEST_TIMEOUT_S": "120"}
        process = ServiceProcess("conveyor.gateway", env=env, name="gateway",
                                 log_path=self.log_dir / "gateway.log",
                                 argv_prefix=("ip", "netns", "exec", namespace))
        self.processes["gateway"] = process
        return process

    def stop(self) -> None:
        for process in self.processes.values():
            process.kill()
        if self.redis_process is not None:
            self.redis_process.kill()
            self.redis_process.wait()


@pytest.fixture
def cluster(tmp_path):
    reason = _namespaces_unavailable()
    if reason is not None:
        pytest.skip(reason)
    network = Network()
    cluster = Cluster(network, tmp_path)
    try:
        network.create()
        cluster.start_redis()
        start_all([*cluster.replicas("a"), *cluster.replicas("b")])
        cluster.gateway().start(timeout_s=60)
        yield cluster
    finally:
        cluster.stop()
        network.remove()


@dataclass
class Traffic:
    """Requests sent and where they went: engine ids from the response header."""

    engines: collections.Counter = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    num_sent: int = 0


async def send(client: httpx.AsyncClient, traffic: Traffic, count: int = 4) -> None:
    """`count` small completions at once, with prompts that share no KV block."""
    async def one(i: int) -> None:
        traffic.num_sent += 1
        body = {"model": rp.MODEL, "prompt": f"{i} {random.random()}", "max_tokens": 3}
        response = await client.post("/v1/completions", json=body)
        if response.status_code != 200:
            traffic.failures.append(f"{response.status_code} {response.text[:200]}")
            return
        traffic.engines[response.headers["x-conveyor-engine"]] += 1
    await asyncio.gather(*(one(traffic.num_sent + i) for i in range(count)))


async def replica_calls(client: httpx.AsyncClient) -> dict[tuple[str, str], int]:
    return rp.replica_calls((await client.get("/metrics")).text)


async def send_until_served(client, traffic: Traffic, cluster: Cluster, names: list[str],
                            timeout_s: float = 90.0) -> None:
    """Send batches until each named replica got a call (deadline: fail)."""
    deadline = time.monotonic() + timeout_s
    while True:
        await send(client, traffic)
        calls = await replica_calls(client)
        missing = [n for n in names if not _served(n, cluster, traffic, calls)]
        if not missing:
            return
        assert time.monotonic() < deadline, f"no traffic reached {missing}: {calls} " \
            f"{dict(traffic.engines)}"


def _served(name: str, cluster: Cluster, traffic: Traffic, calls: dict) -> bool:
    service = name.split("-")[0]
    if service == "engine":
        return traffic.engines[name] > 0
    return calls.get((service, f"{cluster.addresses[name]}:{_port(service)}"), 0) > 0


def _port(service: str) -> str:
    return {"tokenizer": "50051", "detok": "50053"}[service]


async def registered(cluster: Cluster) -> dict[str, list[str]]:
    redis = Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        engines = await EngineRegistry(redis, prefix=PREFIX).list_live()
        listing = {"engine": [e.address for e in engines]}
        for service in ("tokenizer", "detok"):
            registry = ServiceRegistry(redis, service=service, entry_type=ReplicaEntry,
                                       prefix=PREFIX)
            listing[service] = [e.address for e in await registry.list_live()]
        return listing
    finally:
        await redis.aclose()


def _engine_lines(gateway: ServiceProcess) -> str:
    """The gateway's warnings about engines (what it did when one died)."""
    return "".join(line for line in gateway.lines if "engine" in line and "WARNING" in line)


def _start_in_background(processes: list[ServiceProcess]):
    pool = ThreadPoolExecutor(1)
    return pool, asyncio.get_running_loop().run_in_executor(pool, start_all, processes)


async def test_replicas_across_namespaces_share_traffic_scale_and_survive_a_kill(cluster):
    listing = await registered(cluster)
    subnet = f"10.231.{cluster.network.octet}."
    assert all(a.startswith(subnet) for addresses in listing.values() for a in addresses)
    assert sorted(listing["engine"]) == sorted(
        f"{cluster.addresses[n]}:50052" for n in ("engine-a", "engine-b"))

    traffic = Traffic()
    first = [f"{s}-{r}" for s in ("tokenizer", "detok", "engine") for r in ("a", "b")]
    async with httpx.AsyncClient(base_url=cluster.gateway_url, timeout=120,
                                 trust_env=False) as client:
        await send_until_served(client, traffic, cluster, first)

        pool, starting = _start_in_background(cluster.replicas("c"))
        while not starting.done():
            await send(client, traffic, count=2)  # traffic goes on while they start
        await starting
        pool.shutdown()
        third = ["tokenizer-c", "detok-c", "engine-c"]
        await send_until_served(client, traffic, cluster, third)
        assert traffic.failures == []

        for name in ("tokenizer-a", "detok-a", "engine-a"):
            cluster.processes[name].kill()
        after = Traffic()
        for _ in range(6):
            await send(client, after)
        assert after.failures == [], after.failures
        assert after.engines["engine-a"] == 0, _engine_lines(cluster.processes["gateway"])
        calls = await replica_calls(client)

    print(f"\ncross-host per-replica requests ({traffic.num_sent} before the kill, "
          f"{after.num_sent} after):")
    for name in sorted(cluster.processes):
        service = name.split("-")[0]
        if service == "engine":
            print(f"  {name:12} {cluster.addresses[name]:>15}  {traffic.engines[name]:4d} "
                  f"+ {after.engines[name]:2d} after the kill")
        elif service != "gateway":
            key = (service, f"{cluster.addresses[name]}:{_port(service)}")
            print(f"  {name:12} {cluster.addresses[name]:>15}  {calls.get(key, 0):4d} calls")
