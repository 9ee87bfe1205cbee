"""gpu_check part 2: decode attention's achieved bandwidth against a device copy.

K/V bytes one decode step's attention reads (batch x context x kv heads x head dim x 2
x element size) over the median time of one backend forward (store included, CUDA
events after warm-up), against a device-to-device `copy_` of a large buffer (bytes read
+ written). The check: the triton backend's default tiles reach TARGET of the copy at
every shape; a sweep of the key tile (BLOCK_N) is printed beside it for tuning.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
from dataclasses import dataclass

from bench.gpu_kernel_checks import Case, make_forward, random_step

SHAPES = [(64, 1024), (64, 4096)]
"""(batch, context length) of the checked runs."""
HEADS = (32, 8, 128)
"""Query heads, KV heads, head dim (an 8B Llama's attention layer)."""
COPY_BYTES = 2 << 30
TARGET = 0.70
SWEEP_BLOCK_N = (32, 128)
"""Key tiles timed besides the default (64), triton only."""


@dataclass(slots=True)
class BandwidthRow:
    batch: int
    context_len: int
    kv_bytes: int
    triton_ms: float
    torch_ms: float
    sweep_ms: dict[int, float]

    def gbps(self, ms: float) -> float:
        return self.kv_bytes / ms / 1e6


def median_ms(fn, warmup: int, iters: int) -> float:
    """Median of `iters` timings of fn() with CUDA events, after `warmup` calls."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_gbps(iters: int) -> float:
    """Device-to-device copy_ of COPY_BYTES, counted as bytes read + bytes written."""
    import torch

    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup=3, iters=iters)
    return 2 * COPY_BYTES / ms / 1e6


def _with_block_n(block_n: int):
    return lambda plan: dataclasses.replace(
        plan, tiles=dataclasses.replace(plan.tiles, block_n=block_n))


def decode_bandwidth(batch: int, context_len: int, dtype, iters: int) -> BandwidthRow:
    num_heads, num_kv_heads, head_dim = HEADS
    case = Case("bandwidth", 16, num_kv_heads, num_heads // num_kv_heads, head_dim,
                [(context_len - 1, 1)] * batch)
    step = random_step(case, dtype, "cuda")
    kv_bytes = batch * context_len * num_kv_heads * head_dim * 2 * step.kv_cache.element_size()
    ms = {name: median_ms(make_forward(name, step, step.kv_cache), warmup=3, iters=iters)
          for name in ("triton", "torch")}
    sweep = {n: median_ms(make_forward("triton", step, step.kv_cache, _with_block_n(n)),
                          warmup=3, iters=iters) for n in SWEEP_BLOCK_N}
    return BandwidthRow(batch, context_len, kv_bytes, ms["triton"], ms["torch"], sweep)


def run_bandwidth(dtype_name: str, iters: int) -> tuple[float, list[BandwidthRow]]:
    import torch

    copy = copy_gbps(iters)
    print(f"  device-to-device copy: {copy:.0f} GB/s (read + write)", flush=True)
    rows = []
    for batch, context_len in SHAPES:
        row = decode_bandwidth(batch, context_len, getattr(torch, dtype_name), iters)
        rows.append(row)
        ratio = row.gbps(row.triton_ms) / copy
        sweep = ", ".join(f"BLOCK_N {n}: {row.gbps(ms) / copy:.2f}"
                          for n, ms in row.sweep_ms.items())
        print(f"  {'PASS' if ratio >= TARGET else 'FAIL'} batch {batch} x {context_len}: "
              f"triton {row.gbps(row.triton_ms):.0f} GB/s ({ratio:.2f} of copy; {sweep}), "
              f"torch {row.gbps(row.torch_ms):.0f} GB/s", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    return copy, rows


def passed(copy: float, rows: list[BandwidthRow]) -> bool:
    return all(r.gbps(r.triton_ms) / copy >= TARGET for r in rows)


def bandwidth_markdown(copy: float, rows: list[BandwidthRow], dtype_name: str) -> list[str]:
    heads = "{} query heads, {} KV heads, head dim {}".format(*HEADS)
    sweep_heads = " | ".join(f"BLOCK_N {n}" for n in SWEEP_BLOCK_N)
    lines = ["### Decode attention bandwidth", "",
             f"One decode token per request, {heads}, block size 16, {dtype_name}; K/V bytes "
             "read per call / median time of one backend forward (store included). "
             f"Device-to-device `copy_` of {COPY_BYTES >> 30} GiB: {copy:.0f} GB/s "
             f"(read + write). Target: triton at least {TARGET:.0%} of the copy.", "",
             f"| batch | context | K/V MiB | triton GB/s | of copy | {sweep_heads} | torch GB/s "
             "| result |", "|---:|---:|---:|---:|---:|" + "---:|" * len(SWEEP_BLOCK_N)
             + "---:|---|"]
    for r in rows:
        ratio = r.gbps(r.triton_ms) / copy
        sweep = " | ".join(f"{r.gbps(r.sweep_ms[n]) / copy:.2f}" for n in SWEEP_BLOCK_N)
        lines.append(f"| {r.batch} | {r.context_len} | {r.kv_bytes >> 20} | "
                     f"{r.gbps(r.triton_ms):.0f} | {ratio:.2f} | {sweep} | "
                     f"{r.gbps(r.torch_ms):.0f} | {'PASS' if ratio >= TARGET else 'FAIL'} |")
    return lines + [""]
