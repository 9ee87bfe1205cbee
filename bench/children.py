"""A benchmark stopped with SIGTERM stops what it started.

Python's default SIGTERM ends the process at once, so the `with` blocks that stop a
benchmark's services and peer servers never run and those processes live on; and
`subprocess.run` answers its caller's exception by SIGKILLing the child, which then cannot
stop its own. `stop_on_sigterm` makes SIGTERM unwind the stack like Ctrl-C does, and
`run_python` hands the stop on to a child (SIGTERM, then waits for it).
"""

from __future__ import annotations

import signal
import subprocess
import sys


def stop_on_sigterm() -> None:
    """SIGTERM raises SystemExit(143) in the main thread (exit status as if killed by it)."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def run_python(args: list[str], **popen_kwargs) -> None:
    """`python ARGS` in a child process, as `subprocess.run(..., check=True)`, except that an
    exception here (SIGTERM above, Ctrl-C) sends the child SIGTERM and waits for it."""
    with subprocess.Popen([sys.executable, *args], **popen_kwargs) as child:
        try:
            code = child.wait()
        except BaseException:
            child.terminate()
            child.wait()
            raise
    if code:
        raise subprocess.CalledProcessError(code, [sys.executable, *args])
