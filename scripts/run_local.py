"""Run the whole pipeline locally on the CPU with the bundled model (`make run`).

Starts tokenizer, engine, detok and gateway as processes (the same commands the
containers run: `python -m conveyor.<service>`), waits until each is up, prints
the URL, and on Ctrl-C stops everything it started. Redis is started before
this by `make redis`. Any CONVEYOR_* variable in the environment passes through.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # devkit: the repository's dev-only helpers
    sys.path.insert(0, str(REPO_ROOT))

from devkit.service_process import ServiceProcess  # noqa: E402

LOG_DIR = Path(os.environ.get("CONVEYOR_LOG_DIR", ".run-logs"))
BATCH_TOKEN = secrets.token_urlsafe(24)
"""The gateway and the batch worker share this run's internal batch-line token."""


@dataclass
class LocalService:
    """One service of the local pipeline and the environment it runs with."""

    name: str
    module: str
    env: dict[str, str] = field(default_factory=dict)

    @property
    def installed(self) -> bool:
        return importlib.util.find_spec(f"{self.module}.__main__") is not None


SERVICES = [
    LocalService("tokenizer", "conveyor.tokenizer", {"CONVEYOR_TOKENIZER_PORT": "50051"}),
    LocalService("engine", "conveyor.engine",
                 {"CONVEYOR_ENGINE_PORT": "50052", "CONVEYOR_ENGINE_METRICS_PORT": "9102"}),
    LocalService("detok", "conveyor.detok", {"CONVEYOR_DETOK_PORT": "50053"}),
    LocalService("gateway", "conveyor.gateway", {
        "CONVEYOR_GATEWAY_PORT": "8000",
        "CONVEYOR_GATEWAY_TOKENIZER_ADDRESS": "127.0.0.1:50051",
        "CONVEYOR_GATEWAY_ENGINE_ADDRESSES": "127.0.0.1:50052",
        "CONVEYOR_GATEWAY_DETOK_ADDRESS": "127.0.0.1:50053",
        # Local use: no API keys (the gateway logs a warning). Compose turns them on.
        "CONVEYOR_GATEWAY_AUTH_ENABLED": "false",
        "CONVEYOR_GATEWAY_BATCH_TOKEN": BATCH_TOKEN,
    }),
    # One batch worker (Celery on the same Redis): the Batch API works out of the box.
    LocalService("batch", "conveyor.batch", {
        "CONVEYOR_BATCH_GATEWAY_URL": "http://127.0.0.1:8000",
        "CONVEYOR_BATCH_GATEWAY_TOKEN": BATCH_TOKEN,
    }),
]


def _start(service: LocalService) -> ServiceProcess:
    env = {**service.env, **{k: v for k, v in os.environ.items() if k.startswith("CONVEYOR_")}}
    process = ServiceProcess(f"{service.module}", env=env, name=service.name,
                             log_path=LOG_DIR / f"{service.name}.log")
    print(f"starting {service.name} (log: {LOG_DIR / service.name}.log) ...", flush=True)
    return process.start(timeout_s=600)


def main() -> int:
    LOG_DIR.mkdir(exist_ok=True)
    missing = [s.name for s in SERVICES if not s.installed]
    if missing:
        print(f"not built yet, not started: {', '.join(missing)}")
    started: list[ServiceProcess] = []
    stop = False

    def request_stop(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        for service in SERVICES:
            if service.installed and not stop:
                started.append(_start(service))
                where = f"listening on 127.0.0.1:{started[-1].port}" if started[-1].port \
                    else "ready"
                print(f"  {service.name} {where}", flush=True)
        if not stop:
            gateway = next((p for p in started if p.name == "gateway"), None)
            if gateway:
                print(f"\nConveyor is up: http://127.0.0.1:{gateway.port}/v1 "
                      "(model smollm2-135m-instruct). Ctrl-C stops it.", flush=True)
            else:
                print("\nNo gateway yet: the gRPC services above are up. Ctrl-C stops them.")
        while not stop and all(p.is_alive() for p in started):
            time.sleep(0.5)
        for p in started:
            if not p.is_alive():
                print(f"{p.name} exited; its last output:\n{p.output()[-2000:]}", file=sys.stderr)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        for p in reversed(started):
            print(f"stopping {p.name} (pid {p.pid})", flush=True)
            p.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
