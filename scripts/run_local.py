"""Run the whole pipeline locally on the CPU with the bundled model (`make run`).

Starts tokenizer, engine, detok, gateway and one batch worker as processes on the fixed
ports below (devkit/stack.py: the commands the containers run, `python -m
conveyor.<service>`), prints the URL, and on Ctrl-C stops everything it started. Redis is
started before this by `make redis`. Any CONVEYOR_* variable in the environment passes
through and wins over the launcher's settings.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # devkit: the repository's dev-only helpers
    sys.path.insert(0, str(REPO_ROOT))

from devkit.stack import PIPELINE, Stack, StackSpec, installed  # noqa: E402

LOG_DIR = Path(os.environ.get("CONVEYOR_LOG_DIR", ".run-logs"))
SERVICES = (*PIPELINE, "batch")
"""The batch worker (Celery on the same Redis) makes the Batch API work out of the box."""
PORTS = {"tokenizer": 50051, "engine": 50052, "detok": 50053, "gateway": 8000}
ENGINE = {"METRICS_PORT": "9102"}


def local_spec(environ: Mapping[str, str] = os.environ) -> StackSpec:
    """`make run`'s stack: the services built so far, no API keys (the gateway logs a
    warning; compose turns them on), the engine's /metrics on 9102."""
    return StackSpec(LOG_DIR, services=tuple(s for s in SERVICES if installed(s)),
                     ports=PORTS, engine=ENGINE,
                     env={k: v for k, v in environ.items() if k.startswith("CONVEYOR_")})


def serve(stack: Stack, stop: threading.Event) -> None:
    """Print where the stack listens, then wait for `stop` or a process's exit."""
    if "gateway" in stack.processes:
        print(f"\nConveyor is up: {stack.api_url} (model {stack.spec.model}). Ctrl-C stops it.",
              flush=True)
    else:
        print("\nNo gateway yet: the gRPC services above are up. Ctrl-C stops them.", flush=True)
    while all(p.is_alive() for p in stack.processes.values()):
        if stop.wait(0.5):
            return
    for process in stack.processes.values():
        if not process.is_alive():
            print(f"{process.name} exited; its last output:\n{process.output()[-2000:]}",
                  file=sys.stderr)


def main() -> int:
    logging.basicConfig(format="%(message)s", stream=sys.stdout)
    logging.getLogger("devkit.stack").setLevel(logging.INFO)  # what starts and stops
    spec = local_spec()
    missing = [s for s in SERVICES if s not in spec.services]
    if missing:
        print(f"not built yet, not started: {', '.join(missing)}")
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with Stack(spec) as stack:
            if not stop.is_set():
                serve(stack, stop)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
