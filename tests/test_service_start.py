"""Processes still starting are stopped when their starter is interrupted: a benchmark
stopped with SIGTERM while its stack came up used to leave the services started so far
running (Stack.stop knows only the stages that finished starting)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SLOW_SERVICE = """
import os, sys, time
open(sys.argv[0] + ".pid", "w").write(str(os.getpid()))  # never prints that it listens
time.sleep(120)
"""
STARTER = """
import sys
from bench.children import stop_on_sigterm
from devkit.service_process import ServiceProcess, start_all
stop_on_sigterm()
start_all([ServiceProcess("slow_service", env={"PYTHONPATH": sys.argv[1]})], timeout_s=120)
"""


def test_an_interrupted_start_stops_what_it_started(tmp_path: Path):
    (tmp_path / "slow_service.py").write_text(SLOW_SERVICE)
    pid_file = tmp_path / "slow_service.py.pid"
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path)], cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline, "the service never started"
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        starter.send_signal(signal.SIGTERM)
        assert starter.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        starter.kill()
        starter.wait()
    assert not _alive(pid), "the half-started service outlived its starter"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
