"""A benchmark stopped with SIGTERM stops its children, and they get to clean up: before,
the benchmark died at once and `subprocess.run` SIGKILLed the child, whose services lived on."""

import signal
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys, time
from bench.children import stop_on_sigterm
stop_on_sigterm()
try:
    print("ready", flush=True)
    time.sleep(120)
finally:
    open(sys.argv[1], "w").write("stopped its services")
"""
PARENT = """
import sys
from bench.children import run_python, stop_on_sigterm
stop_on_sigterm()
run_python(["-c", sys.argv[1], sys.argv[2]])
"""


def test_sigterm_reaches_the_child_and_both_unwind(tmp_path: Path):
    marker = tmp_path / "marker"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(marker)],
                              cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"  # the child is up
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        parent.kill()
        parent.wait()
    assert marker.read_text() == "stopped its services"
