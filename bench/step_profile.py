"""Where a decode step's time goes, by part of the engine, in process.

For each concurrency N it starts N requests with 256-token random prompts, runs their
prefill, then times `--num-steps` decode steps with a timer around each part of the
step (exclusive time: a part's own time minus the parts inside it):

  schedule        the scheduler's schedule() + update_from_output()
  step inputs     StepInputBuilder.build (flattening the SchedulerOutput into tensors)
  attention plan  the backend's per-step plan
  linear          every CpuLinear or QuantizedLinear (q/k/v, o, gate/up, down, lm_head)
  logits          compute_logits minus its linear (the tied head's F.linear where no
                  CpuLinear or QuantizedLinear replaced it)
  attention       the attention backend's forward (K/V store, gather, SDPA)
  rmsnorm         RMSNorm (2 per layer + the final one), with the residual add before it
  rotary          the cos/sin lookup and the q/k rotation
  mlp act         SwiGLU's silu(gate) * up (LlamaMLP minus its linears)
  layer glue      residual adds, splits and views (layer and attention forwards minus parts)
  sampling        the sampler
  engine other    EngineCore.step minus all of the above (timing records, deltas)

The timers cost ~1 us per call (~400 calls a step), ~1-2% of a one-row step. With
--torch-profile the same steps also run under torch.profiler and the top ops print.
Variants for A/B runs (fresh process each): --torch-ops runs the torch versions of the
fused layer ops (model/fused_ops.py); --onednn-one-row sends one-row linears through
oneDNN's packed GEMM instead of the column-major GEMV (model/cpu_linear.py).
--pulse BURN_MS:PERIOD_MS runs a process alongside that burns BURN_MS of CPU every PERIOD_MS
(what the served pipeline's gateway, detok and client do around each token); --pulse 1:0
keeps one core busy all the time.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench step-profile [--threads N] [--concurrency 1,16,64]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

PROMPT_LEN = 256


class PartTimer:
    """Exclusive seconds per part: a wrapped call's time minus that of wrapped calls inside."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # per open call: [child seconds]

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._stack.append([0.0])
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                children = self._stack.pop()[0]
                self.seconds[name] += elapsed - children
                if self._stack:
                    self._stack[-1][0] += elapsed
        return timed

    def reset(self) -> None:
        self.seconds.clear()


def instrument(llm, timer: PartTimer) -> None:
    """Wrap the parts of `llm`'s step (instance attributes, so only this engine)."""
    from conveyor.engine.model import llama
    from conveyor.engine.model.cpu_linear import CpuLinear
    from conveyor.engine.model.quantized_linear import QuantizedLinear
    from conveyor.engine.model.rms_norm import RMSNorm

    core = llm.core
    runner = core.runner
    model = runner.model
    core.step = timer.wrap("engine other", core.step)
    for name in ("schedule", "update_from_output"):
        setattr(core.scheduler, name, timer.wrap("schedule", getattr(core.scheduler, name)))
    runner.inputs.build = timer.wrap("step inputs", runner.inputs.build)
    runner.backend.plan = timer.wrap("attention plan", runner.backend.plan)
    runner.backend.forward = timer.wrap("attention", runner.backend.forward)
    runner.sampler.sample = timer.wrap("sampling", runner.sampler.sample)
    model.compute_logits = timer.wrap("logits", model.compute_logits)
    model.model.rotary_emb.lookup = timer.wrap("rotary", model.model.rotary_emb.lookup)
    llama.apply_rotary = timer.wrap("rotary", llama.apply_rotary)
    for module in model.modules():
        if isinstance(module, (CpuLinear, QuantizedLinear)):
            module.forward = timer.wrap("linear", module.forward)
        elif isinstance(module, RMSNorm):
            module.forward = timer.wrap("rmsnorm", module.forward)
            module.add_and_norm = timer.wrap("rmsnorm", module.add_and_norm)
        elif isinstance(module, llama.LlamaMLP):
            module.forward = timer.wrap("mlp act", module.forward)
        elif isinstance(module, (llama.LlamaDecoderLayer, llama.LlamaAttention,
                                 llama.LlamaModel)):
            module.forward = timer.wrap("layer glue", module.forward)


def start_requests(llm, n: int, seed: int) -> None:
    """Add n requests and step until each has its first token (prefill done)."""
    from bench.serving.workload import load_prompt_maker
    from conveyor.engine.engine_request import EngineRequest
    from conveyor.engine.sampling_params import SamplingParams

    maker = load_prompt_maker(seed=seed)
    params = SamplingParams(temperature=0.0, max_tokens=1024, ignore_eos=True)
    for i in range(n):
        llm.core.add_request(EngineRequest(f"p{n}-{i}", maker.random_ids(PROMPT_LEN), params))
    started: set[str] = set()
    while len(started) < n:
        started.update(d.request_id for d in llm.core.step())


def profile_decode(llm, timer: PartTimer, n: int, num_steps: int) -> dict:
    """Median step ms and mean ms per part over `num_steps` decode steps of n requests."""
    start_requests(llm, n, seed=n)
    for _ in range(2):
        llm.core.step()
    timer.reset()
    steps = []
    for _ in range(num_steps):
        start = time.perf_counter()
        llm.core.step()
        steps.append(time.perf_counter() - start)
    llm.core.abort(llm.core.unfinished_request_ids)
    llm.core.step()
    parts = {k: v / num_steps * 1e3 for k, v in sorted(timer.seconds.items(),
                                                          key=lambda kv: -kv[1])}
    return {"concurrency": n, "step_ms_median": statistics.median(steps) * 1e3,
            "step_ms_mean": statistics.fmean(steps) * 1e3, "parts_ms": parts}


def apply_variants(args) -> None:
    """Patch the engine's modules for the variants the flags ask for (before it loads)."""
    if args.torch_ops:
        from conveyor.engine.model import fused_ops

        fused_ops.native_ops = lambda: None
    if args.onednn_one_row:
        import torch

        from conveyor.engine.model.cpu_linear import CpuLinear

        def forward(self, x):
            if self._packed is None:
                return torch.nn.functional.linear(x, self.weight, self.bias)
            rows = x.numel() // self.in_features
            out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, self.in_features),
                                                     self._packed, self.bias, "none", [], "")
            return out.view(*x.shape[:-1], self.out_features)

        CpuLinear.forward = forward


PULSE_CODE = """
import sys, time
burn, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    end = time.perf_counter() + burn
    while time.perf_counter() < end or period == 0:
        pass
    time.sleep(max(0.0, period - burn))
"""


@contextmanager
def pulse_alongside(spec: str | None):
    """A process burning CPU in pulses while the block runs (None: nothing)."""
    if spec is None:
        yield
        return
    import subprocess

    burn_ms, period_ms = spec.split(":")
    child = subprocess.Popen([sys.executable, "-c", PULSE_CODE, burn_ms, period_ms])
    try:
        yield
    finally:
        child.kill()
        child.wait()


@contextmanager
def torch_profile(enabled: bool, label: str):
    if not enabled:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield
    print(f"--- torch.profiler, {label} ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


def format_result(r: dict) -> str:
    total = r["step_ms_mean"]
    lines = [f"concurrency {r['concurrency']}: step {r['step_ms_median']:.1f} ms median, "
             f"{total:.1f} ms mean"]
    for name, ms in r["parts_ms"].items():
        lines.append(f"  {name:15s} {ms:8.2f} ms  {100 * ms / total:5.1f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency", default=[1, 16, 64],
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--num-steps", type=int, default=10)
    p.add_argument("--torch-profile", action="store_true")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--torch-ops", action="store_true", help="no fused C++ layer ops")
    p.add_argument("--onednn-one-row", action="store_true", help="oneDNN for one-row linears")
    p.add_argument("--pulse", default=None, help="BURN_MS:PERIOD_MS of CPU alongside")
    args = p.parse_args(argv)
    apply_variants(args)
    with pulse_alongside(args.pulse):
        return run(args)


def run(args) -> int:
    from conveyor.engine import LLM

    llm = LLM(args.model, max_num_seqs=max(args.concurrency), kv_cache_gib=1.0,
              max_model_len=2048, torch_threads=args.threads, dtype=args.dtype)
    timer = PartTimer()
    instrument(llm, timer)
    results = []
    for n in args.concurrency:
        with torch_profile(args.torch_profile, f"concurrency {n}"):
            results.append(profile_decode(llm, timer, n, args.num_steps))
        print(format_result(results[-1]), flush=True)
    if args.json:
        variants = {"torch_ops": args.torch_ops, "onednn_one_row": args.onednn_one_row}
        Path(args.json).write_text(json.dumps({"threads": args.threads, **variants,
                                               "steps": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
