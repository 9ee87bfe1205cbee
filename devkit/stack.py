"""The pipeline as processes, started one way for the tests, the benchmarks and `make run`.

A `StackSpec` says what runs (settings by field name, ports, Redis, extra environment);
`Stack` starts it: tokenizer, engine and detok in parallel (each loads the model or its
tokenizer and needs nothing else), then the gateway with their addresses, then the batch
worker with the gateway's URL. It stops them in reverse order, and `process()` makes more
processes set up like its own for callers that start extra gateways or engines.
"""

from __future__ import annotations

import importlib.util
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from conveyor.common.settings import DEFAULT_MODEL
from devkit.service_process import ServiceProcess, settings_env, start_all, without_torch_env

log = logging.getLogger(__name__)

MODEL_SERVICES = ("tokenizer", "engine", "detok")
PIPELINE = (*MODEL_SERVICES, "gateway")
TORCH_FREE = ("tokenizer", "detok")
"""The services whose containers have no torch."""
ADDRESS_SETTINGS = {"tokenizer": "TOKENIZER_ADDRESS", "engine": "ENGINE_ADDRESSES",
                    "detok": "DETOK_ADDRESS"}
"""The gateway setting that names each model service's address."""


def module_of(service: str) -> str:
    """The module a service runs as (`python -m conveyor.<service>`, as in its container)."""
    return f"conveyor.{service}"


def installed(service: str) -> bool:
    """Whether `service` can start yet (its package has a `__main__`)."""
    return importlib.util.find_spec(f"{module_of(service)}.__main__") is not None


@dataclass(frozen=True)
class StackSpec:
    """What a stack runs. Each service's environment follows from it: `settings_of` (by
    field name), then `env`, then `service_env`; later ones win."""

    log_dir: Path
    """Each process writes `<name>.log` here."""
    model: str = DEFAULT_MODEL
    services: tuple[str, ...] = PIPELINE
    """What to start; add "batch" for a batch worker."""
    tokenizer: Mapping[str, str] = field(default_factory=dict)
    engine: Mapping[str, str] = field(default_factory=dict)
    detok: Mapping[str, str] = field(default_factory=dict)
    gateway: Mapping[str, str] = field(default_factory=dict)
    batch: Mapping[str, str] = field(default_factory=dict)
    """Settings of each service by field name (MAX_MODEL_LEN), over the ones the stack sets."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Every process's environment, over all settings: OTEL_* exporters, `make run`'s
    CONVEYOR_* passthrough."""
    service_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """One service's own environment, by service name, over `env` (an engine from another
    checkout's PYTHONPATH)."""
    redis_url: str | None = None
    redis_prefix: str | None = None
    """Redis and key namespace of every service that uses Redis (None: its default)."""
    register_replicas: bool = True
    """Off: tokenizer, engine and detok register nowhere; the gateway dials the addresses
    it is given. On: they register under `redis_prefix`, so a restarted engine is found."""
    ports: Mapping[str, int] = field(default_factory=dict)
    """Fixed ports by service name; the others bind a free one."""
    torch_free: bool = False
    """Tokenizer and detok without torch, as their containers run."""
    files_dir: Path | None = None
    """The gateway's and batch worker's folder of files (None: their default)."""
    batch_token: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)
    """The internal token the gateway and this stack's batch worker share."""
    timeout_s: float = 600
    """How long each process may take to start."""

    def settings_of(self, service: str, ports: Mapping[str, int] | None = None
                    ) -> dict[str, str]:
        """`service`'s settings by field name; `ports` are the running services' (the
        gateway dials them, the batch worker sends to the gateway)."""
        ports = ports or {}
        own = {**self._port(service), **self._redis(service)}
        if service in MODEL_SERVICES:
            own["MODEL"] = self.model
        if service == "gateway":
            own |= {"AUTH_ENABLED": "false", **self._files(), **_addresses(ports)}
            if "batch" in self.services:
                own["BATCH_TOKEN"] = self.batch_token
        if service == "batch":
            own |= {"GATEWAY_TOKEN": self.batch_token, **self._files()}
            if "gateway" in ports:
                own["GATEWAY_URL"] = f"http://127.0.0.1:{ports['gateway']}"
        return {**own, **getattr(self, service)}

    def env_of(self, service: str, settings: Mapping[str, str]) -> dict[str, str]:
        """`service`'s environment entries with these settings (torch aside)."""
        return {**settings_env(service, settings), **self.env,
                **self.service_env.get(service, {})}

    def _port(self, service: str) -> dict[str, str]:
        return {"PORT": str(self.ports.get(service, 0))} if service in PIPELINE else {}

    def _redis(self, service: str) -> dict[str, str]:
        if service in MODEL_SERVICES and not self.register_replicas:
            return {"REDIS_URL": ""}
        given = {"REDIS_URL": self.redis_url, "REDIS_PREFIX": self.redis_prefix}
        return {name: value for name, value in given.items() if value is not None}

    def _files(self) -> dict[str, str]:
        return {"FILES_DIR": str(self.files_dir)} if self.files_dir else {}


def _addresses(ports: Mapping[str, int]) -> dict[str, str]:
    return {setting: f"127.0.0.1:{ports[service]}"
            for service, setting in ADDRESS_SETTINGS.items() if service in ports}


class Stack:
    """The processes of one `StackSpec`, by service name; `with Stack(spec) as stack:`.

    `start()` returns once every process listens, or stops those it started and raises
    with the failed one's output. The stack owns its processes; what `process()` returns
    belongs to the caller."""

    def __init__(self, spec: StackSpec):
        self.spec = spec
        self.processes: dict[str, ServiceProcess] = {}

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> Stack:
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        stages = [MODEL_SERVICES, ("gateway",), ("batch",)]
        try:
            for stage in stages:
                self._start_together([s for s in stage if s in self.spec.services])
        except BaseException:
            self.stop()
            raise
        return self

    def _start_together(self, services: list[str]) -> None:
        if not services:
            return
        processes = {service: self.process(service) for service in services}
        for service, process in processes.items():
            log.info("starting %s (log: %s) ...", service, process.log_path)
        start_all(list(processes.values()), self.spec.timeout_s)
        self.processes |= processes
        for service, process in processes.items():
            where = f"listening on {process.address}" if process.port else "ready"
            log.info("  %s %s", service, where)

    def stop(self) -> None:
        """Stop every process, the last started first."""
        for service, process in reversed(self.processes.items()):
            log.info("stopping %s (pid %s)", service, process.pid)
            process.stop()
        self.processes.clear()

    def process(self, service: str, name: str | None = None,
                env: Mapping[str, str] | None = None, **settings: str) -> ServiceProcess:
        """An unstarted `service` process set up as this stack's, with the addresses of
        the services running now; `settings` (by field name) win over the stack's and `env`
        over everything. Its log is `<name>.log`."""
        name = name or service
        ports = {running: process.port for running, process in self.processes.items()}
        full_env = self.spec.env_of(service, {**self.spec.settings_of(service, ports), **settings})
        if self.spec.torch_free and service in TORCH_FREE:
            full_env |= without_torch_env(self.spec.model, full_env.get("PYTHONPATH"))
        return ServiceProcess(module_of(service), env={**full_env, **(env or {})}, name=name,
                              log_path=self.spec.log_dir / f"{name}.log")

    def restart_engine(self) -> None:
        """Stop the engine and start another like it (with the spec's ENGINE_ID it comes
        back under the same id; gateways find it through the registry)."""
        self.processes["engine"].stop()
        self.processes["engine"] = self.process("engine").start(self.spec.timeout_s)

    @property
    def base_url(self) -> str:
        """The gateway's URL."""
        return f"http://127.0.0.1:{self.processes['gateway'].port}"

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def pids(self) -> dict[str, int]:
        """Each process's pid by service name (for CPU and memory read from /proc)."""
        return {service: process.pid for service, process in self.processes.items()}

    @property
    def redis_url(self) -> str | None:
        return self.spec.redis_url

    @property
    def redis_prefix(self) -> str | None:
        return self.spec.redis_prefix
