"""GPU benchmark (issues 20 and 36): decode attention bandwidth and decode-step throughput.

    python -m bench gpu --out docs/img/gpu_check.md   # needs CUDA; a few minutes
    python -m bench gpu --cpu-interpret               # tiny, on the CPU: the code path only

Self-contained: it needs a Python with torch, triton, numpy and safetensors, and this
repository's `common/` and `services/engine/` sources (put on sys.path here): no installed
project, no model files (random weights of named Llama shapes, devkit/), no services, no
network. Whether the kernels are right is tested, not measured here: `pytest -m gpu`
(services/engine/tests/gpu/: Triton against torch, graph replay against eager, KV sizing).

1. Decode attention bandwidth: the K/V bytes one decode step's attention reads over the
   median time of one backend forward (store included, CUDA events after warm-up), against
   a device-to-device `copy_` (bytes read + written). The triton backend's default tiles
   must reach TARGET of the copy; a sweep of the key tile (BLOCK_N) is timed beside them.
2. Offline decode-step throughput of the model runner (triton attention) on random weights:
   B requests, each `context` tokens into its sequence in blocks of its own, take one decode
   step after another, timed from SchedulerOutput to sampled tokens (greedy); CUDA graphs on
   (the runner's captured graphs) and off (the same runner, eagerly).

The figures go out as a dated Markdown section naming the GPU (--out, else stdout), which
`bench/run_suite.py --report-only` puts into docs/benchmarks.md. Exit status: 0 the target
met, 1 missed, 2 no CUDA device (without --cpu-interpret).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import itertools
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch  # not triton: its interpreter is chosen when it is imported (main)

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "common", ROOT / "services" / "engine"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

TARGET = 0.70
"""Share of the device copy's bandwidth decode attention must reach."""
SWEEP_BLOCK_N = (32, 128)
"""Key tiles timed besides the triton plan's default (64)."""
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Plan:
    """What runs: the figures on a GPU, or the code path only (--cpu-interpret)."""

    device: str
    dtype: str
    iters: int
    """Timed calls or steps per figure."""
    target: float
    heads: tuple[int, int, int]
    """Query heads, KV heads, head dim of the attention timed."""
    attention_runs: tuple[tuple[int, int], ...]
    """(batch, context length) of the attention timed."""
    copy_bytes: int
    model_shapes: tuple[str, ...]
    batches: tuple[int, ...]
    context: int
    """Tokens in each request's sequence when its timed decode steps start."""

    @classmethod
    def on_gpu(cls, dtype: str, iters: int) -> Plan:
        """An 8B Llama's attention layer; SmolLM2-135M's and Llama-3.2-1B's shapes."""
        return cls("cuda", dtype, iters, TARGET, (32, 8, 128), ((64, 1024), (64, 4096)),
                   2 << 30, ("smollm2-135m", "llama-3.2-1b"), (1, 16, 64, 256), 512)

    @classmethod
    def on_cpu_interpreter(cls) -> Plan:
        """Tiny shapes under TRITON_INTERPRET=1; the figures mean nothing, so no target."""
        return cls("cpu", "float32", 2, 0.0, (4, 2, 16), ((2, 40),), 1 << 20, ("tiny",),
                   (1, 3), 20)

    @property
    def max_len(self) -> int:
        return self.context + self.iters + 8

    @property
    def torch_dtype(self):
            return getattr(torch, self.dtype)


def time_ms(fn, device: str) -> float:
    """One call's time: CUDA events on a GPU (the device's time), else the wall clock."""
    if device == "cpu":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def median_ms(fn, plan: Plan, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median([time_ms(fn, plan.device) for _ in range(plan.iters)])


def free_device_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()  # a no-op without CUDA


@dataclass(slots=True)
class BandwidthRow:
    batch: int
    context_len: int
    kv_bytes: int
    ms: dict[str, float]
    """Median ms of a forward by label: triton, torch, BLOCK_N <n> (triton)."""

    def share(self, label: str, copy_gbps: float) -> float:
        return self.kv_bytes / self.ms[label] / 1e6 / copy_gbps

    def markdown(self, copy_gbps: float, target: float) -> str:
        def gbps(label):
            return f"{self.kv_bytes / self.ms[label] / 1e6:.0f}"

        share = self.share("triton", copy_gbps)
        sweep = " | ".join(f"{self.share(f'BLOCK_N {n}', copy_gbps):.2f}" for n in SWEEP_BLOCK_N)
        return (f"| {self.batch} | {self.context_len} | {self.kv_bytes >> 20} | "
                f"{gbps('triton')} | {share:.2f} | {sweep} | {gbps('torch')} | "
                f"{'PASS' if share >= target else 'FAIL'} |")


def backend_forward(name: str, step, block_n: int | None = None):
    """A zero-argument forward of backend `name` on `step`, planned once (block_n: the
    triton plan's key tile instead of its default)."""
    from conveyor.engine.attention import create_backend

    backend = create_backend(name, step.spec)
    meta = backend.plan(step.meta)
    if block_n is not None:
        meta = dataclasses.replace(meta, tiles=dataclasses.replace(meta.tiles, block_n=block_n))
    return lambda: backend.forward(step.query, step.key, step.value, step.kv_cache, meta)


def time_decode_attention(plan: Plan, batch: int, context_len: int) -> BandwidthRow:
    from devkit.random_step import random_step

    num_heads, num_kv_heads, head_dim = plan.heads
    step = random_step(block_size=BLOCK_SIZE, num_kv_heads=num_kv_heads,
                       group=num_heads // num_kv_heads, head_dim=head_dim,
                       seqs=[(context_len - 1, 1)] * batch, dtype=plan.torch_dtype)
    step = step.to(plan.device)
    kv_bytes = batch * context_len * num_kv_heads * head_dim * 2 * step.kv_cache.element_size()
    calls = {"triton": backend_forward("triton", step), "torch": backend_forward("torch", step)}
    calls |= {f"BLOCK_N {n}": backend_forward("triton", step, n) for n in SWEEP_BLOCK_N}
    return BandwidthRow(batch, context_len, kv_bytes,
                        {label: median_ms(call, plan) for label, call in calls.items()})


def copy_gbps(plan: Plan) -> float:
    """A device-to-device copy_'s bandwidth, counted as bytes read + bytes written."""
    src = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=plan.device)
    dst = torch.empty_like(src)
    return 2 * plan.copy_bytes / median_ms(lambda: dst.copy_(src), plan) / 1e6


def bandwidth_section(plan: Plan) -> tuple[list[str], bool]:
    """The section's lines, and whether every run reached the target."""
    copy = copy_gbps(plan)
    heads = "{} query heads, {} KV heads, head dim {}".format(*plan.heads)
    lines = ["### Decode attention bandwidth", "",
             f"One decode token per request, {heads}, block size {BLOCK_SIZE}, {plan.dtype}; "
             "K/V bytes read per call / median time of one backend forward (store included). "
             f"Device-to-device `copy_` of {plan.copy_bytes >> 20} MiB: {copy:.0f} GB/s "
             f"(read + write). Target: triton at least {plan.target:.0%} of the copy.", "",
             "| batch | context | K/V MiB | triton GB/s | of copy | "
             + "".join(f"BLOCK_N {n} | " for n in SWEEP_BLOCK_N) + "torch GB/s | result |",
             "|---:|---:|---:|---:|---:|" + "---:|" * len(SWEEP_BLOCK_N) + "---:|---|"]
    print("\n".join(lines), flush=True)
    rows = []
    for batch, context_len in plan.attention_runs:
        rows.append(time_decode_attention(plan, batch, context_len))
        lines.append(rows[-1].markdown(copy, plan.target))
        print(lines[-1], flush=True)
        free_device_memory()
    return lines + [""], all(r.share("triton", copy) >= plan.target for r in rows)


def decode_steps(batch: int, plan: Plan):
    """Decode steps of `batch` requests from plan.context tokens on, one token a step,
    each request in blocks of its own."""
    from conveyor.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
    from conveyor.engine.sampling_params import SamplingParams

    blocks_per_seq = math.ceil(plan.max_len / BLOCK_SIZE)
    tables = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)) for b in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=plan.max_len)
    for p in itertools.count(plan.context):
        yield SchedulerOutput(scheduled=[ScheduledRequest(
            request_id=f"r{b}", token_ids=[3 + b % 64], num_computed_tokens=p,
            block_table=table, slot_mapping=[table[p // BLOCK_SIZE] * BLOCK_SIZE
                                             + p % BLOCK_SIZE],
            needs_sample=True, sampling_params=params, prompt_token_ids=[3 + b % 64],
            output_token_ids=[]) for b, table in enumerate(tables)], block_size=BLOCK_SIZE)


def make_runner(shape: str, plan: Plan):
    """A runner over random weights, its pool sized for the largest batch, graphs up to it
    (on the CPU: the same path without capture)."""
    from conveyor.engine.core.config import EngineConfig
    from conveyor.engine.worker.model_runner import ModelRunner
    from devkit.random_model import random_llama

    largest = max(plan.batches)
    model = random_llama(shape, dtype=plan.torch_dtype, device=plan.device,
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


def median_step_ms(runner, batch: int, plan: Plan) -> float:
    steps = decode_steps(batch, plan)
    for output in itertools.islice(steps, 2):  # warm-up: kernels compiled, buffers settled
        runner.execute(output)
    times = []
    for output in itertools.islice(steps, plan.iters):
        start = time.perf_counter()
        runner.execute(output)  # ends reading the sampled tokens: the step is done
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def throughput_row(runner, shape: str, batch: int, plan: Plan) -> str:
    graphs_ms = median_step_ms(runner, batch, plan)
    graphs, runner.decode_graphs = runner.decode_graphs, None
    eager_ms = median_step_ms(runner, batch, plan)
    runner.decode_graphs = graphs
    return (f"| {shape} | {batch} | {batch / graphs_ms * 1e3:.0f} | "
            f"{batch / eager_ms * 1e3:.0f} | {graphs_ms:.2f} | {eager_ms:.2f} | "
            f"{eager_ms / graphs_ms:.2f}x |")


def throughput_section(plan: Plan) -> list[str]:
    lines = ["### Offline decode-step throughput, CUDA graphs on and off", "",
             f"`ModelRunner` (triton attention, {plan.dtype}) on random weights of the named "
             f"shapes; every request {plan.context} tokens into its sequence, greedy; median of "
             f"{plan.iters} steps, each from SchedulerOutput to sampled tokens. That a graph "
             "replay gives the eager logits is tested (`pytest -m gpu`).", "",
             "| model shape | batch | graphs tok/s | eager tok/s | graphs ms/step | "
             "eager ms/step | speed-up |", "|---|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    for shape in plan.model_shapes:
        runner = make_runner(shape, plan)
        for batch in plan.batches:
            lines.append(throughput_row(runner, shape, batch, plan))
            print(lines[-1], flush=True)
        del runner
        free_device_memory()
    return lines + [""]


def header(plan: Plan) -> list[str]:
    import triton

    name = (torch.cuda.get_device_name() if plan.device == "cuda"
            else "no GPU (CPU, TRITON_INTERPRET=1, tiny shapes: code paths only)")
    return [f"## On a GPU: {name}", "",
            f"`python -m bench gpu` on {datetime.date.today().isoformat()}: {name}, "
            f"torch {torch.__version__}, triton {triton.__version__}.", ""]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the Markdown section here (default: "
                        "stdout)")
    parser.add_argument("--cpu-interpret", action="store_true", help="tiny shapes on the CPU "
                        "under TRITON_INTERPRET=1: the code path, no figures (no GPU needed)")
    parser.add_argument("--dtype", default="bfloat16",
                        choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--iters", type=int, default=20, help="timed calls or steps per "
                        "figure")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # read by triton.jit when the kernels import
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    logging.basicConfig(level=logging.INFO, format="  %(name)s: %(message)s")
    if not args.cpu_interpret and not torch.cuda.is_available():
        print("bench gpu: no CUDA device found. Run it on an NVIDIA GPU, or pass "
              "--cpu-interpret to run its code path with tiny shapes on the CPU.",
              file=sys.stderr)
        return 2
    plan = (Plan.on_cpu_interpreter() if args.cpu_interpret
            else Plan.on_gpu(args.dtype, args.iters))
    start = time.perf_counter()
    bandwidth, met = bandwidth_section(plan)
    text = "\n".join(header(plan) + bandwidth + throughput_section(plan))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    print(f"bench gpu: {'target met' if met else 'target MISSED'} "
          f"({time.perf_counter() - start:.0f} s)")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
