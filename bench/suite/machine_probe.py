"""The machine's own speed, read just before each system of the peer comparison.

On a shared VM the same code can run slower for minutes at a time with no other process of
this machine to blame (the 17:42 peer run of issue 19: Conveyor spent 0.74 engine CPU s per c16
request against 0.57 twenty minutes later, other processes <= 0.05 cores), which the per-
scenario count of other processes' CPU cannot see. So a fixed reference runs in a fresh process
before each system, at the servers' thread count: an fp32 matmul (compute) and a sum over 256
MB (read bandwidth), about a second each. A system whose reference came out well below the
run's best ran on a slower machine, and the report says so.
"""

from __future__ import annotations

import json
import subprocess
import sys

SLOW_FRACTION = 0.85
"""A system's reference below this fraction of the run's best is reported as slow (two readings a
minute apart on a quiet machine differ by up to ~8% in read bandwidth)."""

_PROBE = """
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
a, b = torch.randn(512, 576), torch.randn(576, 1536)
x = torch.ones(64 * 2 ** 20)
def rate(fn, work):
    fn()
    best, end = 0.0, time.perf_counter() + float(sys.argv[2])
    while time.perf_counter() < end:
        start = time.perf_counter()
        for _ in range(8):
            fn()
        best = max(best, 8 * work / (time.perf_counter() - start))
    return best
print(json.dumps({"matmul_gflops": rate(lambda: a @ b, 2 * 512 * 576 * 1536) / 1e9,
                  "read_gbs": rate(x.sum, x.numel() * 4) / 1e9}))
"""


def reference(threads: int, seconds: float = 1.0, timeout_s: float = 120) -> dict | None:
    """{"matmul_gflops", "read_gbs"}: the best rates over `seconds` each in a fresh process
    (None when the probe cannot run: a machine without torch in this interpreter)."""
    try:
        result = subprocess.run([sys.executable, "-c", _PROBE, str(threads), str(seconds)],
                                capture_output=True, text=True, timeout=timeout_s, check=True)
        return json.loads(result.stdout)
    except (subprocess.SubprocessError, OSError, ValueError):
        return None


def slow_systems(systems: dict) -> list[tuple[str, str, float]]:
    """(system, measure, fraction of the run's best) for every reference reading below
    SLOW_FRACTION of the best reading of that measure over the run's systems."""
    readings = {name: s["machine"] for name, s in systems.items() if s.get("machine")}
    slow = []
    for measure in ("matmul_gflops", "read_gbs"):
        best = max((r[measure] for r in readings.values()), default=0.0)
        for name, r in readings.items():
            if best > 0 and r[measure] < SLOW_FRACTION * best:
                slow.append((name, measure, r[measure] / best))
    return slow
