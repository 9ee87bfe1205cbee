"""What a workload runs against: a server over HTTP, or the engine in process.

Servers start one at a time as real processes (`ServiceProcess`, the same bootstrap the
tests and `make run` use) and are stopped by PID when their block ends.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.serving.client import RequestResult
from bench.serving.metrics import BenchmarkMetrics
from bench.serving.runner import RunConfig, run
from bench.serving.workload import BenchRequest

REPO_ROOT = Path(__file__).resolve().parents[2]
CONVEYOR_SERVICES = ("tokenizer", "engine", "detok", "gateway")


@dataclass
class HttpTarget:
    """An OpenAI-compatible server at `base_url`."""

    name: str
    base_url: str
    api_key: str | None = None
    pids: dict[str, int] = field(default_factory=dict)
    """The server's processes by service name (their CPU time is read around a workload)."""

    def run(self, requests: list[BenchRequest], concurrency: int, num_warmup: int = 1,
            duration_s: float | None = None, ignore_eos: bool = True
            ) -> tuple[BenchmarkMetrics, list[RequestResult]]:
        config = RunConfig(base_url=self.base_url, max_concurrency=concurrency,
                           num_warmup=num_warmup, duration_s=duration_s, api_key=self.api_key,
                           ignore_eos=ignore_eos)
        return run(requests, config)


@dataclass
class InProcessTarget:
    """Conveyor's engine in this process (the offline API), closed loop."""

    name: str
    llm: object

    def run(self, requests: list[BenchRequest], concurrency: int, num_warmup: int = 1,
            duration_s: float | None = None) -> tuple[BenchmarkMetrics, list[RequestResult]]:
        from bench.inprocess_engine import run_inprocess

        if num_warmup:
            run_inprocess(self.llm, requests[:num_warmup], 1)
        return run_inprocess(self.llm, requests, concurrency, duration_s=duration_s)


def conveyor_installed() -> list[str]:
    """The Conveyor services that cannot be started yet (no `__main__`)."""
    return [name for name in CONVEYOR_SERVICES
            if importlib.util.find_spec(f"conveyor.{name}.__main__") is None]


def _service(module: str, env: dict[str, str], log_dir: Path):
    from devkit.service_process import ServiceProcess

    name = module.rsplit(".", 1)[-1]
    return ServiceProcess(module, env=env, name=name, log_path=log_dir / f"{name}.log")


def _torch_free_env() -> dict[str, str]:
    """The tokenizer and detok run without torch, as their containers do."""
    from devkit.service_process import without_torch_env

    return without_torch_env()


def ensure_redis() -> None:
    """The gateway keeps quotas and routing in Redis: use the running one or start it."""
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "ensure_redis.py")], check=True)


def gateway_bench_env() -> dict[str, str]:
    """Auth off (the anonymous tenant's tier is unlimited) and Redis keys of this run only,
    so no quota limits the benchmark and no other stack's engines or bindings are seen.
    With BENCH_API_KEY set, auth stays on and that key is sent instead."""
    env = {"CONVEYOR_GATEWAY_REDIS_PREFIX": f"conveyor-bench-{os.getpid()}",
           "CONVEYOR_ENGINE_REDIS_PREFIX": f"conveyor-bench-{os.getpid()}"}
    if not os.environ.get("BENCH_API_KEY"):
        env["CONVEYOR_GATEWAY_AUTH_ENABLED"] = "false"
    return env


@contextlib.contextmanager
def conveyor_pipeline(log_dir: Path, engine_env: dict[str, str] | None = None,
                      timeout_s: float = 600, name: str = "conveyor") -> Iterator[HttpTarget]:
    """Tokenizer, engine, detok and gateway as processes on free ports; stopped on exit."""
    log_dir.mkdir(parents=True, exist_ok=True)
    ensure_redis()
    shared = gateway_bench_env()
    started = []
    try:
        tokenizer = _service("conveyor.tokenizer", {"CONVEYOR_TOKENIZER_PORT": "0",
                                                    **_torch_free_env()}, log_dir)
        engine = _service("conveyor.engine", {"CONVEYOR_ENGINE_PORT": "0",
                                              "CONVEYOR_ENGINE_METRICS_PORT": "0",
                                              **shared, **(engine_env or {})}, log_dir)
        detok = _service("conveyor.detok", {"CONVEYOR_DETOK_PORT": "0", **_torch_free_env()},
                         log_dir)
        for process in (tokenizer, engine, detok):
            started.append(process.start(timeout_s))
        gateway = _service("conveyor.gateway", {
            "CONVEYOR_GATEWAY_PORT": "0",
            "CONVEYOR_GATEWAY_TOKENIZER_ADDRESS": tokenizer.address,
            "CONVEYOR_GATEWAY_ENGINE_ADDRESSES": engine.address,
            "CONVEYOR_GATEWAY_DETOK_ADDRESS": detok.address, **shared,
        }, log_dir)
        started.append(gateway.start(timeout_s))
        yield HttpTarget(name, f"http://127.0.0.1:{gateway.port}",
                         os.environ.get("BENCH_API_KEY"),
                         pids={p.name: p.pid for p in (tokenizer, engine, detok, gateway)})
    finally:
        for process in reversed(started):
            process.stop()


@contextlib.contextmanager
def hf_static_server(log_dir: Path, max_batch_size: int = 64,
                     timeout_s: float = 300) -> Iterator[HttpTarget]:
    """Baseline (a) as a process on a free port, with the engine's torch threads; stopped
    on exit."""
    log_dir.mkdir(parents=True, exist_ok=True)
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    process = _service("bench.baselines.hf_static_server", {
        "BENCH_HF_PORT": "0", "BENCH_HF_MAX_BATCH_SIZE": str(max_batch_size),
        "BENCH_HF_THREADS": os.environ.get("CONVEYOR_ENGINE_TORCH_THREADS", "0"),
        "PYTHONPATH": pythonpath}, log_dir)
    try:
        process.start(timeout_s)
        yield HttpTarget("hf-static", f"http://127.0.0.1:{process.port}",
                         pids={"hf-static": process.pid})
    finally:
        process.stop()


@contextlib.contextmanager
def inprocess_engine(**settings) -> Iterator[InProcessTarget]:
    """Baseline (b): the offline engine, released (and its memory) on exit."""
    from bench.inprocess_engine import make_llm

    llm = make_llm(**settings)
    try:
        yield InProcessTarget("in-process", llm)
    finally:
        del llm
        gc.collect()
