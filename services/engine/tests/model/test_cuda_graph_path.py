"""The CUDA-graph decode path as far as a CPU can run it: capture sizes, bucketing,
padding into the persistent input buffers, and the runner replaying through the same
buffers (DecodeGraphs(capture=False) runs the forward a graph would replay)."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine.attention.metadata import PADDING_SLOT
from conveyor.engine.core.config import EngineConfig
from conveyor.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.worker.cuda_graphs import bucket_for, capture_sizes
from conveyor.engine.worker.step_inputs import StepInputBuilder

BLOCK = 4


def scheduled(i: int, num_computed: int, num_new: int = 1) -> ScheduledRequest:
    """Request i with blocks 10*i.. and its next num_new tokens."""
    blocks = [10 * i + b for b in range(-(-(num_computed + num_new) // BLOCK))]
    positions = range(num_computed, num_computed + num_new)
    return ScheduledRequest(
        request_id=f"r{i}", token_ids=[7 + i] * num_new, num_computed_tokens=num_computed,
        block_table=blocks,
        slot_mapping=[blocks[p // BLOCK] * BLOCK + p % BLOCK for p in positions],
        needs_sample=True, sampling_params=SamplingParams(temperature=0.0),
        prompt_token_ids=[1], output_token_ids=[])


def step(*requests: ScheduledRequest) -> SchedulerOutput:
    return SchedulerOutput(scheduled=list(requests), block_size=BLOCK)


def builder(max_num_seqs: int = 16) -> StepInputBuilder:
    return StepInputBuilder(max_num_batched_tokens=64, max_num_seqs=max_num_seqs,
                            max_model_len=64, block_size=BLOCK, device=torch.device("cpu"))


@pytest.mark.parametrize(("largest", "sizes"), [
    (1, (1,)), (3, (1, 2, 3)), (8, (1, 2, 4, 8)), (20, (1, 2, 4, 8, 16, 20)),
    (64, (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)),
])
def test_capture_sizes_pad_by_at_most_seven_rows(largest, sizes):
    assert capture_sizes(largest) == sizes


def test_pure_decode_steps_take_the_next_captured_size():
    sizes = capture_sizes(20)
    assert bucket_for(step(*(scheduled(i, 5) for i in range(5))), sizes) == 8
    assert bucket_for(step(*(scheduled(i, 5) for i in range(16))), sizes) == 16
    assert bucket_for(step(*(scheduled(i, 5) for i in range(17))), sizes) == 20
    assert bucket_for(step(scheduled(0, 5)), sizes) == 1


def test_other_steps_run_eagerly():
    sizes = capture_sizes(8)
    assert bucket_for(step(scheduled(0, 5), scheduled(1, 0, 3)), sizes) is None  # a chunk
    assert bucket_for(step(*(scheduled(i, 5) for i in range(9))), sizes) is None  # too many
    assert bucket_for(step(), sizes) is None
    assert bucket_for(step(scheduled(0, 5)), ()) is None  # graphs off


def test_padding_fills_rows_that_write_nothing_and_read_block_zero():
    inputs = builder().build(step(scheduled(0, 5), scheduled(1, 9), scheduled(2, 0)), pad_to=8)
    meta = inputs.meta
    assert meta.num_tokens == 8 and meta.num_requests == 8 and meta.is_decode_only
    assert meta.slot_mapping.tolist()[:3] == [5, 49, 80]
    assert meta.slot_mapping.tolist()[3:] == [PADDING_SLOT] * 5
    assert meta.query_start_loc.tolist() == list(range(9))
    assert meta.seq_lens.tolist() == [6, 10, 1, 1, 1, 1, 1, 1]
    assert meta.positions.tolist() == [5, 9, 0, 0, 0, 0, 0, 0]
    assert meta.token_request.tolist() == list(range(8))
    assert meta.block_tables[3:, 0].tolist() == [0] * 5
    assert inputs.input_ids.tolist() == [7, 8, 9, 0, 0, 0, 0, 0]
    assert inputs.sample_indices.tolist() == [0, 1, 2]


def test_padded_steps_reuse_the_same_buffers_in_place():
    b = builder()
    first = b.build(step(scheduled(0, 5), scheduled(1, 9)), pad_to=4)
    pointers = [t.data_ptr() for t in (first.input_ids, first.meta.slot_mapping,
                                       first.meta.block_tables, first.meta.seq_lens)]
    second = b.build(step(scheduled(3, 2)), pad_to=4)
    assert [t.data_ptr() for t in (second.input_ids, second.meta.slot_mapping,
                                   second.meta.block_tables, second.meta.seq_lens)] == pointers
    assert first.input_ids.tolist() == [10, 0, 0, 0]  # a view: it now shows step two
    assert first.meta.slot_mapping.tolist() == [122, PADDING_SLOT, PADDING_SLOT, PADDING_SLOT]


def test_padding_is_refused_for_chunks_and_past_the_buffers():
    with pytest.raises(ValueError, match="decode step"):
        builder().build(step(scheduled(0, 0, 3)), pad_to=4)
    with pytest.raises(ValueError, match="max_num_seqs=4"):
        builder(max_num_seqs=4).build(step(scheduled(0, 5)), pad_to=8)


@pytest.mark.parametrize(("device", "backend", "enabled", "expected"), [
    ("cuda", "triton", True, True), ("cuda", "triton", False, False),
    ("cuda", "torch", True, False), ("cpu", "triton", True, False),
])
def test_graphs_only_on_a_device_with_the_triton_backend(device, backend, enabled, expected):
    config = EngineConfig(model="x", device=device, attention_backend=backend,
                          cuda_graphs=enabled)
    assert config.uses_cuda_graphs is expected


def test_runner_replays_decode_steps_through_the_padded_buffers(tiny_runner, make_driver):
    """A padded 'replay' of decode steps gives the eager tokens, writes the same KV, and
    the padding rows leave the pool alone."""
    eager, graphed = tiny_runner(), tiny_runner()
    graphed.decode_graphs = graphed.build_decode_graphs(capture=False)
    assert graphed.decode_graphs.sizes == (1, 2, 4, 8, 16)
    replayed = []
    run = graphed.decode_graphs.run
    graphed.decode_graphs.run = lambda output, size: replayed.append(size) or run(output, size)
    results = []
    for runner in (eager, graphed):
        driver = make_driver(runner, token_budget=64, seed=3)
        for i in range(5):
            driver.add(f"r{i}", [3 + i, 17, 40 + i, 9][: 2 + i % 3], 4)
        results.append(driver.run())
    assert results[0] == results[1]
    assert replayed and set(replayed) == {8}  # 5 decodes padded to 8, every decode step
    for eager_cache, graphed_cache in zip(eager.kv_caches, graphed.kv_caches, strict=True):
        torch.testing.assert_close(graphed_cache, eager_cache, rtol=1e-5, atol=1e-5)


def test_graphs_are_refused_over_the_torch_backend(tiny_runner):
    runner = tiny_runner(attention_backend="torch")
    with pytest.raises(ValueError, match="attention_backend triton"):
        runner.build_decode_graphs(capture=False)
