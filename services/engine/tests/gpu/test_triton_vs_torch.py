"""The `triton` backend's KV store and attention against the `torch` backend (the
reference) on random paged steps: ragged decode, one sequence over many blocks, and mixed
steps (first prefill chunks longer than one query tile, chunks after a prefix hit, decode
rows), in each dtype. On a CUDA device the shapes are a served model's; under the CPU
interpreter they are tiny and the dtypes fp32 and bf16 (fp16 adds nothing there)."""

from __future__ import annotations

import random

import pytest
import torch

from conveyor.engine.attention import create_backend
from devkit.random_step import random_step

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
"""Attention passes when |triton - torch| <= tol * (1 + |torch|) everywhere: a few units in
the last place of the dtype (both backends round their output; torch's SDPA and the
kernel's 16-bit dot round the probabilities to the dtype). The store must be bit-exact."""



def ragged_decodes(num: int) -> list[tuple[int, int]]:
    """`num` decode rows over 1 to 3,000 cached tokens each (seeded)."""
    rng = random.Random(0)
    return [(rng.randint(1, 3000), 1) for _ in range(num)]


CUDA_CASES = [
    # block_size, kv heads, group, head_dim, [(cached, new) per request]
    pytest.param(16, 8, 4, 128, ragged_decodes(32), id="decode-ragged-x32-bs16-gqa4"),
    pytest.param(32, 1, 8, 64, ragged_decodes(32), id="decode-ragged-x32-bs32-gqa8-hd64"),
    pytest.param(16, 2, 4, 128, [(16383, 1)], id="one-sequence-over-1024-blocks-bs16-gqa4"),
    pytest.param(16, 3, 3, 64, [(0, 300), (512, 128), (700, 77), *ragged_decodes(8)],
                 id="prefill-300-prefix-hit-chunks-8-decodes-bs16-gqa3"),
    pytest.param(64, 4, 2, 128, [(0, 513), (2000, 37), (1, 1)], id="prefill-chunks-bs64-gqa2"),
]
CPU_CASES = [
    pytest.param(8, 1, 4, 32, [(0, 1), (12, 1), (30, 1), (5, 1)], id="decode-ragged-bs8-gqa4"),
    pytest.param(4, 2, 1, 16, [(0, 5), (7, 1), (3, 1)], id="prefill-and-decode-bs4-mha"),
    pytest.param(16, 2, 3, 16, [(0, 9), (20, 4), (1, 1)], id="prefill-chunks-bs16-gqa3"),
    pytest.param(2, 1, 2, 8, [(45, 1), (0, 3)], id="one-sequence-over-23-blocks-bs2-gqa2"),
    pytest.param(16, 1, 1, 16, [(0, 70), (32, 9), (50, 1)],
                 id="chunk-over-two-tiles-prefix-hit-decode-bs16-mha"),
]
DTYPES = (torch.float32, torch.float16, torch.bfloat16) if ON_CUDA else (torch.float32,
                                                                          torch.bfloat16)


def forward(name: str, step, kv_cache: torch.Tensor) -> torch.Tensor:
    backend = create_backend(name, step.spec)
    return backend.forward(step.query, step.key, step.value, kv_cache, backend.plan(step.meta))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize(("block_size", "kv_heads", "group", "head_dim", "seqs"),
                         CUDA_CASES if ON_CUDA else CPU_CASES)
def test_triton_stores_and_attends_as_torch_does(block_size, kv_heads, group, head_dim, seqs,
                                                 dtype):
    step = random_step(block_size=block_size, num_kv_heads=kv_heads, group=group,
                       head_dim=head_dim, seqs=seqs, dtype=dtype).to(DEVICE)
    torch_cache, triton_cache = step.kv_cache.clone(), step.kv_cache.clone()
    expected = forward("torch", step, torch_cache).float()
    actual = forward("triton", step, triton_cache).float()
    torch.testing.assert_close(triton_cache, torch_cache, rtol=0, atol=0)
    torch.testing.assert_close(actual, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
