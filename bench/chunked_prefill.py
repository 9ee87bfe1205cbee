"""Decode ITL while a long prompt arrives, with chunked prefill on and off (in process).

A few streams decode steadily; once each has tokens, one long prompt arrives. With a
small step budget (`max_num_batched_tokens`, chunked prefill on) the long prompt is cut
into chunks that share steps with the decodes; with a budget as large as the prompt
(off) its whole prefill runs in one step and every stream waits for it. Measured: the
streams' inter-token gaps from the long prompt's arrival to its first token, against
the gaps before it arrived, and the long prompt's own TTFT.
"""

from __future__ import annotations

import time

import numpy as np

from bench.inprocess_engine import _engine_request
from bench.serving.workload import BenchRequest, PromptMaker


def measure_decode_itl(llm, maker: PromptMaker, num_streams: int = 4,
                       stream_prompt_len: int = 64, stream_output_len: int = 256,
                       long_prompt_len: int = 2000, warm_tokens: int = 8) -> dict:
    """Figures in ms: ITL of the streams before and during the long prefill, and its TTFT."""
    core, tokenizer = llm.core, llm.get_tokenizer()
    streams = maker.random_requests(num_streams, stream_prompt_len, stream_output_len,
                                    as_ids=True)
    times: dict[str, list[float]] = {f"s{i}": [] for i in range(num_streams)}
    for request_id, request in zip(times, streams, strict=True):
        core.add_request(_engine_request(request_id, request, tokenizer, True))
    try:
        _step_until(core, times, lambda: min(len(t) for t in times.values()) >= warm_tokens)
        long = BenchRequest(maker.random_ids(long_prompt_len), long_prompt_len, 2)
        arrival = time.perf_counter()
        core.add_request(_engine_request("long", long, tokenizer, True))
        times["long"] = []
        _step_until(core, times, lambda: bool(times["long"]))
        first_long = times["long"][0]
    finally:
        core.abort(core.unfinished_request_ids)
    before, during = _gaps(times, num_streams, arrival, first_long)
    return {
        "long_prompt_len": long_prompt_len,
        "num_streams": num_streams,
        "long_ttft_ms": (first_long - arrival) * 1e3,
        "itl_before_p50_ms": _pct(before, 50),
        "itl_during_p50_ms": _pct(during, 50),
        "itl_during_p99_ms": _pct(during, 99),
        "itl_during_max_ms": max(during, default=0.0),
    }


def _step_until(core, times: dict[str, list[float]], done) -> None:
    while not done() and core.has_unfinished_requests:
        deltas = core.step()
        now = time.perf_counter()
        for delta in deltas:
            if delta.new_token_ids and delta.request_id in times:
                times[delta.request_id].append(now)


def _gaps(times, num_streams: int, arrival: float, first_long: float):
    """Stream gaps (ms) that ended before the arrival, and those that ended after it, up to
    the step that gave the long prompt its first token."""
    before, during = [], []
    for i in range(num_streams):
        stamps = times[f"s{i}"]
        for prev, cur in zip(stamps, stamps[1:], strict=False):
            gap = (cur - prev) * 1e3
            if cur <= arrival:
                before.append(gap)
            elif cur <= first_long:
                during.append(gap)
    return before, during


def _pct(values: list[float], p: float) -> float:
    return float(np.percentile(values, p)) if values else 0.0
