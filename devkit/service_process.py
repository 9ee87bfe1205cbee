"""Start a Conveyor service as a real process for tests, benchmarks and the stack launcher.

The service prints `CONVEYOR_LISTENING port=N` once its server is bound (see
grpc_server.serve_until_signalled and the gateway), which is how the caller
learns the port when it asked for port 0.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from conveyor.common import prepare_model
from conveyor.common.settings import DEFAULT_MODEL

LISTENING = re.compile(r"CONVEYOR_LISTENING port=(\d+)")


class ServiceProcess:
    """A service subprocess (`python -m <module>`) whose output is collected.

    `start()` returns once the process printed its port or raises with the
    process's last output when it died or took longer than `timeout_s`.
    """

    def __init__(self, module: str, env: dict[str, str] | None = None, name: str | None = None,
                 log_path: Path | None = None, argv_prefix: tuple[str, ...] = ()):
        self.module = module
        self.argv_prefix = argv_prefix
        """Run the service under this command (e.g. `ip netns exec NAME`)."""
        self.name = name or module
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = log_path
        self.port: int | None = None
        self.lines: deque[str] = deque(maxlen=400)
        self._proc: subprocess.Popen | None = None
        self._port_seen = threading.Event()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 180.0) -> ServiceProcess:
        self._proc = subprocess.Popen(
            [*self.argv_prefix, sys.executable, "-m", self.module], env=self.env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        )
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not self._port_seen.wait(0.2):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not start:\n{self.output()}")
        return self

    def _pump(self) -> None:
        log = open(self.log_path, "a") if self.log_path else None  # noqa: SIM115
        for line in self._proc.stdout:
            self.lines.append(line)
            if log:
                log.write(line)
                log.flush()
            match = LISTENING.search(line)
            if match and not self._port_seen.is_set():
                self.port = int(match.group(1))
                self._port_seen.set()
        if log:
            log.close()

    def output(self) -> str:
        return "".join(self.lines)

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, wait for the drain, then SIGKILL if it is still there."""
        if self._proc is None or self._proc.poll() is not None:
            return self._proc.returncode if self._proc else None
        self._proc.send_signal(signal.SIGTERM)
        try:
            return self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return self._proc.wait()

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def settings_env(service: str, settings: Mapping[str, str]) -> dict[str, str]:
    """`service`'s settings by field name as its environment: MAX_MODEL_LEN="2048" for the
    engine is CONVEYOR_ENGINE_MAX_MODEL_LEN=2048."""
    return {f"CONVEYOR_{service.upper()}_{name.upper()}": value
            for name, value in settings.items()}


def start_all(processes: Sequence[ServiceProcess], timeout_s: float = 600) -> None:
    """Start `processes` in parallel; if one fails, or this thread is interrupted while they
    start (Ctrl-C, a benchmark's SIGTERM), stop them all and raise."""
    try:
        with ThreadPoolExecutor(len(processes)) as pool:
            starts = [pool.submit(_start, p, timeout_s) for p in processes]
            try:
                errors = [e for e in (start.result() for start in starts) if e]
            except BaseException:  # interrupted: the starts in flight see their process end
                stop_all(processes)
                raise
        if errors:
            raise errors[0]
    except BaseException:
        stop_all(processes)  # again: one may have been spawned after the first
        raise


def _start(process: ServiceProcess, timeout_s: float) -> BaseException | None:
    try:
        process.start(timeout_s=timeout_s)
    except BaseException as exc:  # noqa: BLE001 - re-raised by start_all
        return exc
    return None


def stop_all(processes: Sequence[ServiceProcess]) -> None:
    for process in processes:
        process.kill()


NO_TORCH_PATH = str(Path(__file__).parent / "no_torch")
"""Put this folder first on PYTHONPATH to run a service as its torch-free container
does: its sitecustomize makes `import torch` fail, so transformers never loads it."""


def without_torch_env(model: str = DEFAULT_MODEL, pythonpath: str | None = None
                      ) -> dict[str, str]:
    """Environment entries that start a service process without torch; `pythonpath` (by
    default this process's PYTHONPATH) follows the torch-free folder.

    Converts `model`'s tokenizer into the cache first (in this process, which has torch),
    as the service images do at build time: transformers cannot read GGUF without torch.
    """
    prepare_model.main([model])
    rest = os.environ.get("PYTHONPATH") if pythonpath is None else pythonpath
    return {"PYTHONPATH": NO_TORCH_PATH + (os.pathsep + rest if rest else "")}
