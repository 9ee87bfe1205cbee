"""bench/gpu.py as it runs without a GPU (tiny shapes under the Triton interpreter: its code
path against the engine as it is now), and the bandwidth target on made-up figures."""

import os
import subprocess
import sys
from pathlib import Path

from bench.gpu import BandwidthRow

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_interpret_times_attention_and_steps_and_writes_the_section(tmp_path):
    out = tmp_path / "gpu.md"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--cpu-interpret", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = out.read_text().splitlines()
    assert lines[0] == "## On a GPU: no GPU (CPU, TRITON_INTERPRET=1, tiny shapes: code paths only)"
    assert [line for line in lines if line.startswith("| 2 | 40 |")][0].endswith("| PASS |")
    assert [line.split(" | ")[1] for line in lines if line.startswith("| tiny |")] == ["1", "3"]


def test_decode_attention_passes_at_the_target_share_of_the_copy():
    sweep = {"BLOCK_N 32": 0.5, "BLOCK_N 128": 0.4}
    fast = BandwidthRow(64, 1024, 1 << 30, {"triton": 0.36, "torch": 1.0, **sweep})
    slow = BandwidthRow(64, 4096, 1 << 30, {"triton": 1.0, "torch": 2.0, **sweep})
    assert (fast.markdown(4000.0, 0.7)
            == "| 64 | 1024 | 1024 | 2983 | 0.75 | 0.54 | 0.67 | 1074 | PASS |")
    assert (slow.markdown(4000.0, 0.7)
            == "| 64 | 4096 | 1024 | 1074 | 0.27 | 0.54 | 0.67 | 537 | FAIL |")
