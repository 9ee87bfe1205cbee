"""The KV pool sized at start on a CUDA device. A runner on the ~1B shape's random weights
sizes its pool by profiling the largest step (max_num_batched_tokens over max_num_seqs
requests) and must leave the device's use (all processes, as cudaMemGetInfo sees it)
within memory_utilization x total; a memory_utilization too small for one max_model_len
sequence is refused naming that setting. The arithmetic: tests/model/test_kv_sizing.py.

The runners start in a child process (this file run as a script), as an engine's does:
in this one, memory that other tests left about counts against the budget (on an H200,
70.0 GiB of a 69.9 GiB budget after the other GPU checks; 69.4 fresh).
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conveyor.engine.core.config import EngineConfig
from conveyor.engine.worker.model_runner import ModelRunner
from devkit.random_model import random_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="sizes the KV pool from a CUDA device's memory")]

SHAPE = "llama-3.2-1b"
UTILIZATION = 0.5
TOO_SMALL = 0.01
"""Of an 80-141 GiB device: less than the weights alone (2.5 GB in bf16)."""
BLOCK_SIZE, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, MAX_MODEL_LEN = 16, 8192, 256, 8192


@pytest.fixture(scope="module")
def started() -> dict:
    """What start_runners() gave in a child process that imports as this one does."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                           timeout=300, env=env)
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.splitlines()[-1])


def test_the_profiled_pool_keeps_the_device_within_memory_utilization(started):
    assert started["num_blocks"] >= math.ceil(MAX_MODEL_LEN / BLOCK_SIZE)
    assert started["used_bytes"] <= UTILIZATION * started["total_bytes"]


def test_a_memory_utilization_too_small_for_one_sequence_is_refused_naming_it(started):
    assert "memory_utilization" in started["refusal"]


def engine_config(memory_utilization: float) -> EngineConfig:
    return EngineConfig(model=f"(random {SHAPE})", device="cuda", dtype="bfloat16",
                        attention_backend="triton", block_size=BLOCK_SIZE,
                        max_model_len=MAX_MODEL_LEN,
                        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                        max_num_seqs=MAX_NUM_SEQS, memory_utilization=memory_utilization,
                        cuda_graphs=False)


def start_runners() -> dict:
    """A runner at UTILIZATION (its pool, and the device's use after it started), then
    one at TOO_SMALL (the error it was refused with)."""
    model = random_llama(SHAPE, dtype=torch.bfloat16, device="cuda", attention_backend="triton")
    runner = ModelRunner(engine_config(UTILIZATION), model=model)
    free, total = torch.cuda.mem_get_info()
    started = {"num_blocks": runner.capacity.num_blocks, "used_bytes": total - free,
               "total_bytes": total, "refusal": "(started: not refused)"}
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    try:
        ModelRunner(engine_config(TOO_SMALL), model=model)
    except ValueError as exc:
        started["refusal"] = str(exc)
    return started


if __name__ == "__main__":
    print(json.dumps(start_runners()))
