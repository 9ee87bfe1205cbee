"""bench/gpu_check.py's correctness part, as it runs without a GPU (Triton interpreter)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_interpret_checks_triton_against_torch_and_passes(tmp_path):
    out = tmp_path / "gpu_check.md"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"),
                           "--cpu-interpret", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in out.read_text().splitlines() if line.endswith("| PASS |")]
    assert len(rows) >= 4 and not any("FAIL" in line for line in out.read_text().splitlines())
