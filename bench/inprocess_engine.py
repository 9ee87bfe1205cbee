"""Baseline (b): the engine in process (offline API), driven like the serving benchmark.

`LLM.generate` runs a fixed list to completion; to compare with the served pipeline at
the same concurrency this drives the LLM's engine core in a closed loop instead: keep
`concurrency` requests in flight, add the next one as soon as one finishes, and time
every token the step loop hands back. The results go through the same metric code
(TTFT, TPOT, ITL, throughput) as the HTTP benchmark, so the gap between the two is what
the gateway, tokenizer, detok and gRPC cost.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from bench.serving.client import RequestResult
from bench.serving.metrics import BenchmarkMetrics, Slo, calculate_metrics
from bench.serving.workload import BenchRequest


def make_llm(**settings):
    """The offline engine with the bundled model (settings: EngineSettings fields)."""
    from conveyor.engine import LLM

    return LLM(**settings)


def _engine_request(request_id: str, request: BenchRequest, tokenizer, ignore_eos: bool,
                    structured_outputs=None, lora=None):
    from conveyor.engine.engine_request import EngineRequest
    from conveyor.engine.sampling_params import SamplingParams

    ids = request.prompt if isinstance(request.prompt, list) else tokenizer(
        request.prompt, add_special_tokens=False)["input_ids"]
    params = SamplingParams(**{"temperature": 0.0, **dict(request.sampling)},
                            max_tokens=request.max_tokens, ignore_eos=ignore_eos,
                            structured_outputs=structured_outputs)
    return EngineRequest(request_id, list(ids), params, lora=lora)


def run_inprocess(llm, requests: list[BenchRequest], concurrency: int,
                  ignore_eos: bool = True, slo: Slo | None = None,
                  duration_s: float | None = None, structured_outputs=None,
                  loras: list | None = None) -> tuple[BenchmarkMetrics, list[RequestResult]]:
    """Closed loop over `llm.core` with `concurrency` requests in flight; every request
    constrained by `structured_outputs` (a StructuredOutputsParams) when given; request i
    runs with LoRA adapter `loras[i % len(loras)]` (None: the base model) when given."""
    core, tokenizer = llm.core, llm.get_tokenizer()
    queue, ids = deque(requests), itertools.count()
    adapters = itertools.cycle(loras or [None])
    live: dict[str, tuple[RequestResult, float]] = {}  # id -> (result, last token time)
    done: list[RequestResult] = []
    start = time.perf_counter()
    deadline = start + duration_s if duration_s else float("inf")

    def admit() -> None:
        while queue and len(live) < concurrency and time.perf_counter() < deadline:
            request = queue.popleft()
            request_id = f"bench-{next(ids)}"
            now = time.perf_counter()
            # The request's clock starts before tokenization, as a server's would.
            result = RequestResult(prompt_len=request.prompt_len, start_time=now)
            core.add_request(_engine_request(request_id, request, tokenizer, ignore_eos,
                                             structured_outputs, next(adapters)))
            live[request_id] = (result, now)

    admit()
    while live:
        stepped = core.step()
        deltas = getattr(stepped, "deltas", stepped)  # a revision before issue 31 (A/B runs)
        now = time.perf_counter()
        for delta in deltas:
            _record(live, done, delta, now)
        admit()
    return calculate_metrics(done, time.perf_counter() - start, slo), done


def _record(live, done, delta, now: float) -> None:
    result, last = live[delta.request_id]
    if delta.new_token_ids:
        if result.output_tokens == 0:
            result.ttft = now - result.start_time
        else:
            result.itl.append(now - last)
        result.output_tokens += len(delta.new_token_ids)
        live[delta.request_id] = (result, now)
        last = now
    if delta.finished:
        del live[delta.request_id]
        result.latency = last - result.start_time
        result.success = delta.error is None and result.output_tokens > 0
        result.error = delta.error or ""
        done.append(result)
