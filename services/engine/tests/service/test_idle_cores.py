"""The engine's default thread count: cores minus those busy by both the 1-minute load and
the CPU in use now, where the engine's sibling services (the Conveyor services its launcher
started with it) do not count as other work."""

import json
import os
import signal
import subprocess
import sys

import pytest

from conveyor.engine.idle_cores import idle_cores

SPIN = "while True: pass"
MEASURE = ("import json; from conveyor.engine.idle_cores import busy_cores; "
           "print(json.dumps(busy_cores(1.0)))")


@pytest.mark.parametrize(("cores", "load", "busy_now", "threads"), [
    (2, 1.4, 0.0, 2),    # the load of work that has ended (a build): every core
    (2, 1.4, 1.0, 1),    # work that goes on: a core left to it
    (2, 0.3, 2.0, 2),    # a burst the last minute does not show: every core
    (8, 3.2, 2.9, 5),
    (2, 2.6, 2.0, 1),    # never fewer than 1
    (2, 1.4, None, 1),   # no /proc: the load alone
])
def test_threads_are_the_cores_neither_measure_shows_busy(cores, load, busy_now, threads):
    assert idle_cores(cores, load, busy_now) == threads


def _busy_cores_beside(spinner: list[str]) -> tuple[float, float]:
    """busy_cores measured by a child of this process while `spinner` (and whatever it
    starts, in its own process group) runs."""
    spin = subprocess.Popen(spinner, start_new_session=True)
    try:
        out = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    finally:
        os.killpg(spin.pid, signal.SIGKILL)
        spin.wait()
    host, family = json.loads(out)
    return host, family


def test_a_busy_sibling_service_is_the_familys_own_work():
    # its command line names a conveyor module as `python -m conveyor.<name>` does
    host, family = _busy_cores_beside([sys.executable, "-c", SPIN, "-m", "conveyor.spinner"])
    assert family >= 0.3, (host, family)


def test_a_busy_sibling_that_is_no_service_is_other_work():
    """A shell's background job beside `python -m bench offline`, say."""
    host, family = _busy_cores_beside([sys.executable, "-c", SPIN])
    assert family < 0.3 and host - family >= 0.3, (host, family)


def test_a_busy_process_of_another_parent_is_other_work():
    nested = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {SPIN!r}])"
    host, family = _busy_cores_beside([sys.executable, "-c", nested])
    assert family < 0.3 and host - family >= 0.3, (host, family)
