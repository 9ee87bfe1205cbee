"""gpu_check part 4: the engine's memory sizing on the device, as it starts.

A model runner on the ~1B shape's random weights, with the pool sized by profiling
(no fixed num_blocks): it runs the largest step (max_num_batched_tokens over
max_num_seqs requests), measures the peak, gives the rest of memory_utilization x
device memory to KV blocks and logs capacity and max concurrency. Checks: the device's
use after start-up (all processes, as cudaMemGetInfo sees it) stays within
memory_utilization x total; and a memory_utilization too small for one max_model_len
sequence is refused with an error naming that setting.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

SHAPE = "llama-3.2-1b"
UTILIZATION = 0.5
TOO_SMALL = 0.01
"""Of an 80-141 GiB device: less than the weights alone (2.5 GB in bf16)."""
MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, MAX_MODEL_LEN = 8192, 256, 8192


@dataclass(slots=True)
class SizingResult:
    total_gib: float
    used_gib: float
    num_blocks: int
    num_tokens: int
    max_concurrency: float
    refusal: str

    @property
    def within_budget(self) -> bool:
        return self.used_gib <= UTILIZATION * self.total_gib

    @property
    def refused(self) -> bool:
        return "memory_utilization" in self.refusal

    @property
    def passed(self) -> bool:
        return self.within_budget and self.refused


def _config(dtype: str, utilization: float):
    from conveyor.engine.core.config import EngineConfig

    return EngineConfig(model=f"(random {SHAPE})", device="cuda", dtype=dtype,
                        attention_backend="triton", max_model_len=MAX_MODEL_LEN,
                        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                        max_num_seqs=MAX_NUM_SEQS, memory_utilization=utilization,
                        cuda_graphs=False)


def run_sizing(dtype: str) -> SizingResult:
    import torch

    from conveyor.engine.worker.kv_sizing import GIB
    from conveyor.engine.worker.model_runner import ModelRunner
    from devkit.random_model import random_llama

    model = random_llama(SHAPE, dtype=getattr(torch, dtype), device="cuda",
                         attention_backend="triton")
    runner = ModelRunner(_config(dtype, UTILIZATION), model=model)
    free, total = torch.cuda.mem_get_info()
    capacity = runner.capacity
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    try:
        ModelRunner(_config(dtype, TOO_SMALL), model=model)
        refusal = "(started: not refused)"
    except ValueError as exc:
        refusal = str(exc)
    result = SizingResult(total / GIB, (total - free) / GIB, capacity.num_blocks,
                          capacity.num_tokens, capacity.max_concurrency, refusal)
    print(f"  {'PASS' if result.within_budget else 'FAIL'} {SHAPE}, memory_utilization "
          f"{UTILIZATION}: {result.num_blocks} blocks = {result.num_tokens} tokens, max "
          f"concurrency at {MAX_MODEL_LEN} tokens {result.max_concurrency:.1f}x; device use "
          f"{result.used_gib:.1f} of {result.total_gib:.1f} GiB", flush=True)
    print(f"  {'PASS' if result.refused else 'FAIL'} memory_utilization {TOO_SMALL}: "
          f"{refusal}", flush=True)
    return result


def sizing_markdown(r: SizingResult) -> list[str]:
    return ["### Memory sizing at start", "",
            f"`ModelRunner` on {SHAPE}'s shape (random weights), max_num_batched_tokens "
            f"{MAX_NUM_BATCHED_TOKENS}, max_num_seqs {MAX_NUM_SEQS}, max_model_len "
            f"{MAX_MODEL_LEN}, pool sized by the profiling pass.", "",
            "| check | figure | result |", "|---|---|---|",
            f"| memory_utilization {UTILIZATION}: KV capacity | {r.num_blocks} blocks, "
            f"{r.num_tokens} tokens, max concurrency {r.max_concurrency:.1f}x | |",
            f"| device use after start <= {UTILIZATION} x total | {r.used_gib:.1f} of "
            f"{r.total_gib:.1f} GiB | {'PASS' if r.within_budget else 'FAIL'} |",
            f"| memory_utilization {TOO_SMALL} refused naming the setting | {r.refusal} | "
            f"{'PASS' if r.refused else 'FAIL'} |", ""]
