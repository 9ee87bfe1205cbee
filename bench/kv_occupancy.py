"""KV slots holding real tokens vs reserved: paged blocks vs contiguous reservation.

Drives Conveyor's own scheduler and KV cache manager (no model: a fake runner samples
one fixed token per request that needs one) through a mixed-length workload, and after
every step counts, over the running requests:

- real tokens: positions whose KV is written (`num_computed_tokens`),
- paged slots: blocks in their block tables x block_size (what Conveyor allocates),
- contiguous slots, two ways a non-paged engine reserves memory up front:
  `max_model_len` per request (the usual static reservation), and
  `prompt + max_tokens` per request (the best a contiguous allocator can do knowing
  each request's limit in advance).

Occupancy = real tokens / slots, summed over steps (each step weighs the same).

    .venv/bin/python bench/kv_occupancy.py
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Occupancy:
    """Summed over the steps of one run."""

    num_steps: int
    real_tokens: int
    paged_slots: int
    reserved_max_tokens_slots: int
    reserved_max_model_len_slots: int
    block_size: int
    max_model_len: int

    @property
    def paged(self) -> float:
        return self.real_tokens / max(self.paged_slots, 1)

    @property
    def contiguous_max_tokens(self) -> float:
        return self.real_tokens / max(self.reserved_max_tokens_slots, 1)

    @property
    def contiguous_max_model_len(self) -> float:
        return self.real_tokens / max(self.reserved_max_model_len_slots, 1)


def mixed_workload(num_requests: int, seed: int = 0, prompt_range=(16, 1024),
                   output_range=(16, 512)) -> list[tuple[int, int]]:
    """(prompt tokens, max tokens) pairs, uniform in the given ranges."""
    rng = random.Random(seed)
    return [(rng.randint(*prompt_range), rng.randint(*output_range)) for _ in range(num_requests)]


def measure_occupancy(workload: list[tuple[int, int]], block_size: int = 16,
                      max_model_len: int = 2048, num_blocks: int = 4096,
                      max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                      arrivals_per_step: int = 2) -> Occupancy:
    """Run the workload through the real scheduler; requests arrive a few per step."""
    from conveyor.engine.core.config import EngineConfig
    from conveyor.engine.core.request import Request
    from conveyor.engine.core.scheduler import Scheduler
    from conveyor.engine.core.scheduler_output import ModelRunnerOutput, SampledToken
    from conveyor.engine.sampling_params import SamplingParams

    scheduler = Scheduler(EngineConfig(
        num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=False))
    pending = [Request(f"r{i}", [7 + i % 5] * prompt_len,
                       SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))
               for i, (prompt_len, max_tokens) in enumerate(workload)]
    totals = [0, 0, 0, 0, 0]  # steps, real, paged, reserved(max tokens), reserved(max len)
    while pending or scheduler.has_unfinished_requests:
        for request in pending[:arrivals_per_step]:
            scheduler.add_request(request)
        del pending[:arrivals_per_step]
        output = scheduler.schedule()
        sampled = {r.request_id: [SampledToken(9)] for r in output.scheduled if r.needs_sample}
        scheduler.update_from_output(output, ModelRunnerOutput(sampled))
        _count(scheduler, totals, block_size, max_model_len)
    return Occupancy(*totals, block_size=block_size, max_model_len=max_model_len)


def _count(scheduler, totals: list[int], block_size: int, max_model_len: int) -> None:
    running = [r for r in scheduler.running if r.num_computed_tokens]
    if not running:
        return
    totals[0] += 1
    totals[1] += sum(r.num_computed_tokens for r in running)
    totals[2] += sum(len(scheduler.kv.block_table(r)) for r in running) * block_size
    totals[3] += sum(r.num_prompt_tokens + r.max_tokens for r in running)
    totals[4] += len(running) * max_model_len


def format_occupancy(o: Occupancy) -> str:
    return (f"steps {o.num_steps}: real tokens / slots -- paged (block {o.block_size}): "
            f"{o.paged:.1%}; contiguous prompt+max_tokens: {o.contiguous_max_tokens:.1%}; "
            f"contiguous max_model_len {o.max_model_len}: {o.contiguous_max_model_len:.1%}")


def main() -> int:
    for block_size in (16, 32):
        print(format_occupancy(measure_occupancy(mixed_workload(200), block_size=block_size)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
