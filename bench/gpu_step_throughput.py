"""gpu_check part 3: offline decode-step throughput, CUDA graphs on and off.

The model runner (triton attention) on random weights of named Llama shapes
(devkit.random_model): B requests, each CONTEXT tokens into its
sequence, take one decode step after another (block tables point into a pool of their
own; the values there do not change the cost). A step is timed from SchedulerOutput
to sampled tokens (greedy), so the host-side build and the sampler's read count too;
tokens/s = B / median step time. Graphs on replays the runner's captured graphs;
off runs the same runner eagerly. A check first compares one padded replay's logits
with the eager step's.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass

GPU_SHAPES = ("smollm2-135m", "llama-3.2-1b")
GPU_BATCHES = (1, 16, 64, 256)
CONTEXT = 512
BLOCK_SIZE = 16
MIN_COSINE = 0.999
"""Graph replay vs eager logits, row by row (same kernels; the padded batch may take
other GEMM tilings)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What part 3 runs: shapes, batches, steps per figure, context, dtype, device."""

    shapes: tuple[str, ...]
    batches: tuple[int, ...]
    num_steps: int
    context: int
    dtype: str
    device: str

    @classmethod
    def on_gpu(cls, dtype: str, num_steps: int) -> Plan:
        return cls(GPU_SHAPES, GPU_BATCHES, num_steps, CONTEXT, dtype, "cuda")

    @classmethod
    def on_cpu_interpreter(cls) -> Plan:
        """The code path only (CI): a tiny model, figures meaningless."""
        return cls(("tiny",), (1, 5), 2, 20, "float32", "cpu")

    @property
    def max_len(self) -> int:
        return self.context + self.num_steps + 8


@dataclass(slots=True)
class ThroughputRow:
    shape: str
    batch: int
    graphs_ms: float
    eager_ms: float

    def tokens_per_s(self, ms: float) -> float:
        return self.batch / ms * 1e3


class DecodeRequests:
    """B requests with blocks of their own, stepping one token at a time."""

    def __init__(self, batch: int, plan: Plan) -> None:
        from conveyor.engine.sampling_params import SamplingParams

        self.blocks_per_seq = math.ceil(plan.max_len / BLOCK_SIZE)
        self.tables = [list(range(b * self.blocks_per_seq, (b + 1) * self.blocks_per_seq))
                       for b in range(batch)]
        self.params = SamplingParams(temperature=0.0, max_tokens=plan.max_len)
        self.position = plan.context

    def next_step(self):
        from conveyor.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput

        p = self.position
        self.position += 1
        scheduled = [ScheduledRequest(
            request_id=f"r{b}", token_ids=[3 + b % 64], num_computed_tokens=p,
            block_table=table, slot_mapping=[table[p // BLOCK_SIZE] * BLOCK_SIZE
                                             + p % BLOCK_SIZE],
            needs_sample=True, sampling_params=self.params, prompt_token_ids=[3 + b % 64],
            output_token_ids=[]) for b, table in enumerate(self.tables)]
        return SchedulerOutput(scheduled=scheduled, block_size=BLOCK_SIZE)


def make_runner(shape: str, plan: Plan):
    """A runner over random weights, pool sized for the largest batch, graphs up to it
    (on the CPU: the same path without capture)."""
    import torch

    from conveyor.engine.core.config import EngineConfig
    from conveyor.engine.worker.model_runner import ModelRunner
    from devkit.random_model import random_llama

    largest = max(plan.batches)
    model = random_llama(shape, dtype=getattr(torch, plan.dtype), device=plan.device,
                         attention_backend="triton")
    config = EngineConfig(
        model=f"(random {shape})", device=plan.device, dtype=plan.dtype,
        attention_backend="triton", block_size=BLOCK_SIZE, max_model_len=plan.max_len,
        max_num_batched_tokens=max(2048, largest), max_num_seqs=largest,
        num_blocks=largest * math.ceil(plan.max_len / BLOCK_SIZE), seed=0,
        cuda_graphs=True, cuda_graph_max_batch_size=largest)
    runner = ModelRunner(config, model=model)
    if runner.decode_graphs is None:
        runner.decode_graphs = runner.build_decode_graphs(capture=False)
    return runner


def replay_cosine(runner, plan: Plan) -> float:
    """Lowest row cosine of a padded replay's logits against the eager step's."""
    import torch

    batch = min(3, max(plan.batches))  # 3 requests replay at size 4: one padding row
    output = DecodeRequests(batch, plan).next_step()
    graphed = runner.compute_logits(output)
    graphs, runner.decode_graphs = runner.decode_graphs, None
    eager = runner.compute_logits(output)
    runner.decode_graphs = graphs
    return torch.nn.functional.cosine_similarity(graphed, eager, dim=-1).min().item()


def median_step_ms(runner, batch: int, plan: Plan) -> float:
    requests = DecodeRequests(batch, plan)
    for _ in range(2):  # warm-up: kernels compiled, sampler's buffers settled
        runner.execute(requests.next_step())
    times = []
    for _ in range(plan.num_steps):
        output = requests.next_step()
        start = time.perf_counter()
        runner.execute(output)  # ends reading the sampled tokens: the step is done
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_shape(shape: str, plan: Plan) -> tuple[float, list[ThroughputRow]]:
    start = time.perf_counter()
    runner = make_runner(shape, plan)
    print(f"  {shape}: runner ready with {len(runner.decode_graphs.sizes)} decode graphs in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    cosine = replay_cosine(runner, plan)
    print(f"  {'PASS' if cosine >= MIN_COSINE else 'FAIL'} {shape}: graph replay vs eager "
          f"logits, lowest row cosine {cosine:.6f}", flush=True)
    rows = []
    for batch in plan.batches:
        graphs_ms = median_step_ms(runner, batch, plan)
        graphs, runner.decode_graphs = runner.decode_graphs, None
        eager_ms = median_step_ms(runner, batch, plan)
        runner.decode_graphs = graphs
        row = ThroughputRow(shape, batch, graphs_ms, eager_ms)
        rows.append(row)
        print(f"  {shape} batch {batch:3d}: graphs {row.tokens_per_s(graphs_ms):8.0f} tok/s "
              f"({graphs_ms:.2f} ms/step), eager {row.tokens_per_s(eager_ms):8.0f} tok/s "
              f"({eager_ms:.2f} ms/step), {eager_ms / graphs_ms:.2f}x", flush=True)
    del runner
    gc.collect()
    if plan.device == "cuda":
        import torch

        torch.cuda.empty_cache()
    return cosine, rows


def run_throughput(plan: Plan) -> tuple[dict[str, float], list[ThroughputRow]]:
    cosines, rows = {}, []
    for shape in plan.shapes:
        cosines[shape], shape_rows = run_shape(shape, plan)
        rows += shape_rows
    return cosines, rows


def passed(cosines: dict[str, float]) -> bool:
    return all(c >= MIN_COSINE for c in cosines.values())


def throughput_markdown(cosines: dict[str, float], rows: list[ThroughputRow],
                        plan: Plan) -> list[str]:
    checks = ", ".join(f"{shape} {c:.6f}" for shape, c in cosines.items())
    lines = ["### Offline decode-step throughput, CUDA graphs on and off", "",
             f"`ModelRunner` (triton attention, {plan.dtype}) on random weights of the named "
             f"shapes; every request {plan.context} tokens into its sequence, greedy; median of "
             f"{plan.num_steps} steps, each from SchedulerOutput to sampled tokens. Graph "
             f"replay vs eager logits (lowest row cosine, must be >= {MIN_COSINE}): {checks}.",
             "", "| model shape | batch | graphs tok/s | eager tok/s | graphs ms/step | "
             "eager ms/step | speed-up |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.shape} | {r.batch} | {r.tokens_per_s(r.graphs_ms):.0f} | "
              f"{r.tokens_per_s(r.eager_ms):.0f} | {r.graphs_ms:.2f} | {r.eager_ms:.2f} | "
              f"{r.eager_ms / r.graphs_ms:.2f}x |" for r in rows]
    return lines + [""]
