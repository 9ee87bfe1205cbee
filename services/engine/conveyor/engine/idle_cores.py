"""How many torch threads the engine takes when none are set: the cores it may run on minus
those other work keeps busy, where "busy" must show in two measures: the 1-minute load
average (work that lasts) and the CPU used over a quarter second now by processes other than
the engine's sibling services (the Conveyor services one launcher started with it). The load
average alone also counts work that has just ended: after a minute of native builds it read
1.4 on an idle 2-core machine, and `make run`'s engine started with 1 thread instead of 2."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

SAMPLE_S = 0.25
"""How long the CPU in use now is measured."""


@functools.cache
def idle_cpu_count() -> int:
    """Cores this process may use minus those other work keeps busy, at least 1 (measured
    once per process)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0]
    busy_now = None
    if round(load):
        try:
            host, family = busy_cores(SAMPLE_S)
            busy_now = host - family
        except OSError:  # no /proc (not Linux), or not readable here: the load alone
            pass
    return idle_cores(cores or 1, load, busy_now)


def idle_cores(cores: int, load: float, busy_now: float | None) -> int:
    """`cores` minus the busy ones both measures show (the load alone where the CPU in use
    now cannot be read), at least 1."""
    busy = round(load) if busy_now is None else min(round(load), round(busy_now))
    return max(1, cores - busy)


def busy_cores(window_s: float) -> tuple[float, float]:
    """Cores in use over `window_s`: the whole machine's, and those of this process and of
    its sibling services (`python -m conveyor.*` processes of the same parent, when that
    parent is not init)."""
    host, family, start = _host_ticks(), _family_ticks(), time.monotonic()
    time.sleep(window_s)
    host_after, family_after = _host_ticks(), _family_ticks()
    per_s = os.sysconf("SC_CLK_TCK") * (time.monotonic() - start)
    used = sum(ticks - family.get(pid, 0) for pid, ticks in family_after.items())
    return (host_after - host) / per_s, used / per_s


def _host_ticks() -> int:
    """Busy ticks of all CPUs since boot: user, nice, system, irq, softirq (/proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq = map(
        int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8])
    return user + nice + system + irq + softirq


def _family_ticks() -> dict[int, int]:
    """user + system ticks of this process and of its sibling services, by pid."""
    own = os.getpid()
    family = {own: _ticks(own)[1]}
    parent = os.getppid()
    if parent <= 1:
        return family
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != own:
            ppid, ticks = _ticks(int(entry.name))
            if ppid == parent and _is_service(int(entry.name)):
                family[int(entry.name)] = ticks
    return family


def _is_service(pid: int) -> bool:
    """Whether the process runs a Conveyor module (`python -m conveyor.<name>`)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:  # gone, or another user's process hidden from this one
        return False
    return any(flag == b"-m" and module.startswith(b"conveyor.")
               for flag, module in zip(argv, argv[1:], strict=False))


def _ticks(pid: int) -> tuple[int, int]:
    """(parent pid, user + system ticks) of a process; (-1, 0) once it has gone or where it
    cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return -1, 0
    return int(fields[1]), int(fields[11]) + int(fields[12])
