"""The in-process closed loop and the chunked-prefill gap split, over a fake engine core."""

from types import SimpleNamespace

import pytest

from bench.chunked_prefill import _gaps
from bench.inprocess_engine import run_inprocess
from bench.serving.workload import BenchRequest


class FakeCore:
    """Each step gives every live request one token; records the most live at once."""

    def __init__(self):
        self.live, self.max_live = {}, 0

    def add_request(self, request):
        self.live[request.request_id] = request.sampling_params.max_tokens
        self.max_live = max(self.max_live, len(self.live))

    def step(self):
        self.live = {request_id: left - 1 for request_id, left in self.live.items()}
        deltas = [SimpleNamespace(request_id=request_id, new_token_ids=[5], finished=not left,
                                  error=None) for request_id, left in self.live.items()]
        self.live = {request_id: left for request_id, left in self.live.items() if left}
        return deltas


def test_closed_loop_keeps_concurrency_and_counts_tokens():
    llm = SimpleNamespace(core=FakeCore(), get_tokenizer=lambda: lambda text, add_special_tokens:
                          {"input_ids": [1] * len(text.split())})
    requests = [BenchRequest("a b c", 3, 4) for _ in range(10)] + [BenchRequest([1, 2], 2, 2)]
    metrics, results = run_inprocess(llm, requests, concurrency=3)
    assert llm.core.max_live == 3
    assert metrics.completed == 11 and metrics.total_output_tokens == 42
    assert metrics.total_input_tokens == 32
    assert all(len(r.itl) == r.output_tokens - 1 for r in results)
    assert all(r.latency >= r.ttft > 0 for r in results)


def test_a_revision_before_issue_31_steps_to_a_result_with_deltas():
    """`bench serve --in-process --variant old@REV` drives an older engine: its step()
    returned a StepResult holding the deltas."""
    core = FakeCore()
    core.step = lambda step=core.step: SimpleNamespace(deltas=step())
    llm = SimpleNamespace(core=core, get_tokenizer=lambda: None)
    metrics, _ = run_inprocess(llm, [BenchRequest([1, 2], 2, 3)] * 2, concurrency=2)
    assert metrics.completed == 2 and metrics.total_output_tokens == 6


def test_gaps_split_at_the_long_prompt_arrival():
    times = {"s0": [0.0, 1.0, 2.0, 5.0, 6.0], "s1": [0.5, 1.5, 5.0]}
    before, during = _gaps(times, 2, arrival=2.5, first_long=5.0)
    assert before == pytest.approx([1000.0, 1000.0, 1000.0])
    assert during == pytest.approx([3000.0, 3500.0])
