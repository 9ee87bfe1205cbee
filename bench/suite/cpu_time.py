"""CPU seconds a server's processes spend (user + system, from /proc), read around a workload.

A service counts with every live descendant (vLLM's engine core, a worker pool), so the
figure is what the service costs the machine, whichever process does the work.
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


def snapshot(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process tree, and of this process ("client": the load
    generator runs here)."""
    stats = _all_stats()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {**{name: tree_cpu_s(pid, stats) for name, pid in pids.items()},
            "client": usage.ru_utime + usage.ru_stime}


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}
