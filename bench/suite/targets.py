"""What a workload runs against: a server over HTTP, or the engine in process.

Servers start one at a time as real processes (`ServiceProcess`, the same bootstrap the
tests and `make run` use) and are stopped by PID when their block ends.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
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
            duration_s: float | None = None, ignore_eos: bool = True
            ) -> tuple[BenchmarkMetrics, list[RequestResult]]:
        from bench.inprocess_engine import run_inprocess

        if num_warmup:
            run_inprocess(self.llm, requests[:num_warmup], 1, ignore_eos)
        return run_inprocess(self.llm, requests, concurrency, ignore_eos, duration_s=duration_s)


def conveyor_installed() -> list[str]:
    """The Conveyor services that cannot be started yet (no `__main__`)."""
    return [name for name in CONVEYOR_SERVICES
            if importlib.util.find_spec(f"conveyor.{name}.__main__") is None]


def _service(module: str, env: dict[str, str], log_dir: Path):
    from devkit.service_process import ServiceProcess

    name = module.rsplit(".", 1)[-1]
    return ServiceProcess(module, env=env, name=name, log_path=log_dir / f"{name}.log")


def conveyor_spec(log_dir: Path, engine_env: dict[str, str] | None = None,
                  timeout_s: float = 600):
    """The benchmarked pipeline: tokenizer and detok without torch, as their containers run;
    Redis keys of this run only, so no other stack's engines or bindings are seen; auth off
    (the anonymous tenant's tier is unlimited, so no quota limits the benchmark) unless
    BENCH_API_KEY is set, which is then sent instead. `engine_env`: the engine's own
    environment over all of it."""
    from devkit.stack import StackSpec

    return StackSpec(log_dir, torch_free=True, redis_prefix=f"conveyor-bench-{os.getpid()}",
                     gateway={"AUTH_ENABLED": "true"} if os.environ.get("BENCH_API_KEY") else {},
                     service_env={"engine": engine_env or {}}, timeout_s=timeout_s)


@contextlib.contextmanager
def conveyor_pipeline(log_dir: Path, engine_env: dict[str, str] | None = None,
                      timeout_s: float = 600, name: str = "conveyor") -> Iterator[HttpTarget]:
    """Tokenizer, engine, detok and gateway as processes on free ports (devkit/stack.py,
    `conveyor_spec`); stopped on exit."""
    from devkit.local_redis import ensure_redis
    from devkit.stack import Stack

    print(ensure_redis(), file=sys.stderr)
    with Stack(conveyor_spec(log_dir, engine_env, timeout_s)) as stack:
        yield HttpTarget(name, stack.base_url, os.environ.get("BENCH_API_KEY"), pids=stack.pids)


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
