"""A padded CUDA-graph replay of a decode step gives the eager step's logits, on random
weights of named Llama shapes (bfloat16, triton attention): the same kernels, though the
padded batch may take other GEMM tilings. The CPU runs the same path without capture
(tests/model/test_cuda_graph_path.py)."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine.core.config import EngineConfig
from conveyor.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.worker.model_runner import ModelRunner
from devkit.random_model import random_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="captures CUDA graphs: needs a CUDA device")]

BLOCK_SIZE, CONTEXT, MAX_BATCH = 16, 512, 8
BLOCKS_PER_REQUEST = CONTEXT // BLOCK_SIZE + 1
MIN_COSINE = 0.999
"""Of each row's graphed logits with its eager ones."""


def decode_step(num_requests: int) -> SchedulerOutput:
    """One token for each request, CONTEXT tokens into its sequence, in blocks of its own."""
    params = SamplingParams(temperature=0.0)
    scheduled = []
    for i in range(num_requests):
        table = list(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST))
        slot = table[CONTEXT // BLOCK_SIZE] * BLOCK_SIZE + CONTEXT % BLOCK_SIZE
        scheduled.append(ScheduledRequest(
            request_id=f"r{i}", token_ids=[3 + i], num_computed_tokens=CONTEXT,
            block_table=table, slot_mapping=[slot], needs_sample=True, sampling_params=params,
            prompt_token_ids=[3 + i], output_token_ids=[]))
    return SchedulerOutput(scheduled=scheduled, block_size=BLOCK_SIZE)


@pytest.mark.parametrize("shape", ["smollm2-135m", "llama-3.2-1b"])
def test_a_padded_graph_replay_gives_the_eager_logits(shape):
    config = EngineConfig(
        model=f"(random {shape})", device="cuda", dtype="bfloat16", attention_backend="triton",
        block_size=BLOCK_SIZE, max_model_len=BLOCKS_PER_REQUEST * BLOCK_SIZE,
        max_num_batched_tokens=2048, max_num_seqs=MAX_BATCH,
        num_blocks=MAX_BATCH * BLOCKS_PER_REQUEST, seed=0, cuda_graphs=True,
        cuda_graph_max_batch_size=MAX_BATCH)
    model = random_llama(shape, dtype=torch.bfloat16, device="cuda", attention_backend="triton")
    runner = ModelRunner(config, model=model)
    step = decode_step(3)  # replays the graph of 4 rows: one padding row
    assert runner.decode_graphs.bucket_for(step) == 4
    graphed = runner.compute_logits(step)
    runner.decode_graphs = None
    eager = runner.compute_logits(step)
    cosine = torch.nn.functional.cosine_similarity(graphed, eager, dim=-1)
    assert cosine.min().item() >= MIN_COSINE
