"""The scheduler never waits for a device: it does not even import torch (issue 20's
host-device discipline: no synchronisation in the scheduler)."""

from __future__ import annotations

import subprocess
import sys


def test_scheduling_imports_no_tensor_library():
    code = ("import sys\n"
            "import conveyor.engine.core.scheduler, conveyor.engine.core.kv_cache_manager\n"
            "print(sorted({'torch', 'numpy', 'triton'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"
