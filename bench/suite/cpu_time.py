"""CPU seconds a server's processes spend (user + system, from /proc), read around a workload.

A service counts with every live descendant (vLLM's engine core, a worker pool), so the
figure is what the service costs the machine, whichever process does the work. The
machine's busy seconds (/proc/stat) are read too: what neither the server nor the client
spent went to other processes, which on a machine with as many cores as the server has
threads makes every step wait on a descheduled thread (a compiler next to the 2-thread
engine made a mixed run 3x slower).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def parse_stat(text: str) -> tuple[int, float]:
    """(parent pid, utime + stime in seconds) from the text of /proc/<pid>/stat."""
    fields = text[text.rindex(")") + 2:].split()  # the name (field 2) may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _all_stats(proc: Path = Path("/proc")) -> dict[int, tuple[int, float]]:
    stats = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                stats[int(entry.name)] = parse_stat((entry / "stat").read_text())
            except (OSError, ValueError):
                continue  # it ended while being read
    return stats


def tree_cpu_s(root: int, stats: dict[int, tuple[int, float]]) -> float:
    """CPU seconds of `root` and its live descendants."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
            todo.extend(children.get(pid, ()))
    return total


def machine_busy_s(stat: Path = Path("/proc/stat")) -> float:
    """CPU seconds all cores have been busy since boot: user + nice + system + irq + softirq +
    steal (the aggregate "cpu" line; guest time is already inside user)."""
    fields = stat.read_text().split("\n", 1)[0].split()
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def others_s(cpu_spent: dict[str, float], machine_spent: float) -> float:
    """CPU seconds of processes outside `cpu_spent` (the server's trees and the client) while
    the machine was busy for `machine_spent` seconds (never below 0: the two are read a
    moment apart)."""
    return max(0.0, machine_spent - sum(cpu_spent.values()))


def snapshot(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process tree, and of this process ("client": the load
    generator runs here)."""
    stats = _all_stats()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {**{name: tree_cpu_s(pid, stats) for name, pid in pids.items()},
            "client": usage.ru_utime + usage.ru_stime}


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}
