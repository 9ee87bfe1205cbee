"""KV pool sizing arithmetic and the refusal to start when one sequence does not fit."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine.model.model_config import ModelConfig
from conveyor.engine.worker import kv_sizing
from conveyor.engine.worker.kv_cache import allocate_kv_caches, kv_bytes_per_block
from conveyor.engine.worker.profile_step import profiling_step

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, max_position_embeddings=8192)


def test_bytes_per_block_matches_the_formula():
    # 2 x 30 layers x 3 kv heads x 64 x 4 bytes = 45 KiB per token in fp32.
    assert kv_bytes_per_block(SMOLLM2, 1, torch.float32) == 45 * 1024
    assert kv_bytes_per_block(SMOLLM2, 16, torch.bfloat16) == 45 * 1024 * 16 // 2


def test_cpu_blocks_from_gib():
    per_block = kv_bytes_per_block(SMOLLM2, 16, torch.float32)
    assert kv_sizing.num_blocks_for_cpu(1.0, per_block) == (1 << 30) // (45 * 1024 * 16)


def test_gpu_blocks_from_what_is_left():
    blocks = kv_sizing.num_blocks_for_gpu(total_bytes=100 * 2**30, memory_utilization=0.9,
                                          peak_torch_bytes=10 * 2**30,
                                          non_torch_bytes=2**30, bytes_per_block=2**20)
    assert blocks == 79 * 1024
    assert kv_sizing.num_blocks_for_gpu(total_bytes=10, memory_utilization=0.5,
                                        peak_torch_bytes=20, non_torch_bytes=0,
                                        bytes_per_block=1) == 0


def test_capacity_and_concurrency():
    capacity = kv_sizing.KVCapacity(num_blocks=1000, block_size=16, max_model_len=2000)
    assert capacity.num_tokens == 16000
    assert capacity.blocks_per_max_len_sequence == 125
    assert capacity.max_concurrency == 8.0


@pytest.mark.parametrize(("cuda", "setting"), [(False, "kv_cache_gib"),
                                               (True, "memory_utilization")])
def test_refuses_pool_smaller_than_one_sequence(cuda, setting):
    capacity = kv_sizing.KVCapacity(num_blocks=10, block_size=16, max_model_len=161)
    with pytest.raises(ValueError, match=f"raise {setting} or lower max_model_len"):
        kv_sizing.check_capacity(capacity, device_is_cuda=cuda)
    kv_sizing.check_capacity(kv_sizing.KVCapacity(11, 16, 161), device_is_cuda=cuda)


def test_kv_pool_layout():
    caches = allocate_kv_caches(SMOLLM2, num_blocks=3, block_size=4, dtype=torch.bfloat16,
                                device="cpu")
    assert len(caches) == 30
    assert caches[0].shape == (2, 3, 4, 3, 64) and caches[0].dtype == torch.bfloat16


def test_profiling_step_fills_the_budget():
    step = profiling_step(max_num_batched_tokens=100, max_num_seqs=8, block_size=16,
                          max_model_len=64)
    assert step.output.num_batched_tokens == 100
    assert len(step.output.scheduled) == 8
    used = {b for r in step.output.scheduled for b in r.block_table}
    assert used == set(range(step.num_blocks))
    assert all(r.needs_sample for r in step.output.scheduled)


def test_profiling_step_respects_max_model_len():
    step = profiling_step(max_num_batched_tokens=2048, max_num_seqs=2, block_size=16,
                          max_model_len=100)
    assert [len(r.token_ids) for r in step.output.scheduled] == [100, 100]
