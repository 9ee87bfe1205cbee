"""bench/gpu_check.py as it runs without a GPU (Triton interpreter), and the Markdown of
the parts that only a GPU runs, from figures made up here."""

import os
import subprocess
import sys
from pathlib import Path

from bench import gpu_bandwidth, gpu_memory_sizing

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_interpret_checks_triton_against_torch_and_runs_the_step_path(tmp_path):
    out = tmp_path / "gpu_check.md"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"),
                           "--cpu-interpret", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.endswith("| PASS |")]
    assert len(rows) >= 10 and "FAIL" not in text
    assert "graph replay vs eager" in proc.stdout and "PASS tiny" in proc.stdout
    throughput = [line for line in text.splitlines() if line.startswith("| tiny |")]
    assert [line.split(" | ")[1] for line in throughput] == ["1", "5"]


def test_bandwidth_rows_pass_at_the_target_share_of_the_copy():
    copy = 4000.0
    row = gpu_bandwidth.BandwidthRow(64, 1024, 1 << 30, triton_ms=0.36, torch_ms=1.0,
                                     sweep_ms={32: 0.5, 128: 0.4})
    slow = gpu_bandwidth.BandwidthRow(64, 4096, 1 << 30, triton_ms=1.0, torch_ms=2.0,
                                      sweep_ms={32: 1.0, 128: 1.0})
    assert gpu_bandwidth.passed(copy, [row]) and not gpu_bandwidth.passed(copy, [row, slow])
    table = gpu_bandwidth.bandwidth_markdown(copy, [row, slow], "bfloat16")
    assert table[-3].startswith("| 64 | 1024 | 1024 | 2983 | 0.75 |")
    assert table[-3].endswith("| PASS |") and table[-2].endswith("| FAIL |")


def test_sizing_passes_within_the_budget_and_on_a_refusal_naming_the_setting():
    result = gpu_memory_sizing.SizingResult(
        total_gib=140.0, used_gib=69.5, num_blocks=1000, num_tokens=16000,
        max_concurrency=1.9, refusal="... raise memory_utilization or lower max_model_len")
    assert result.passed
    result.used_gib = 71.0
    assert not result.passed
    assert "| FAIL |" in "\n".join(gpu_memory_sizing.sizing_markdown(result))
