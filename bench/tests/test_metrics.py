"""The metric math against recorded timings (definitions of vllm bench serve)."""

import numpy as np
import pytest

from bench.serving.client import RequestResult
from bench.serving.metrics import Distribution, Slo, calculate_metrics, tpot_of


def result(ttft, itl, output_tokens, prompt_len=10):
    return RequestResult(prompt_len=prompt_len, success=True, ttft=ttft, itl=list(itl),
                         latency=ttft + sum(itl), output_tokens=output_tokens)


@pytest.mark.parametrize("ttft, itl, output_tokens, tpot", [
    (0.5, [0.1, 0.2, 0.3], 4, (1.1 - 0.5) / 3),  # decode time over the tokens after the first
    (0.2, [0.4], 5, 0.1),  # 2 chunks carrying 5 tokens: divided by 4 tokens, not 1 gap
    (0.3, [], 1, None),  # undefined for one token
])
def test_tpot(ttft, itl, output_tokens, tpot):
    assert tpot_of(result(ttft, itl, output_tokens)) == pytest.approx(tpot)


def test_throughputs_count_only_completed_requests():
    results = [result(0.1, [0.1] * 3, 4, prompt_len=100),
               result(0.2, [0.1] * 3, 4, prompt_len=50),
               RequestResult(prompt_len=1000, error="boom")]
    m = calculate_metrics(results, duration_s=2.0)
    assert (m.completed, m.failed) == (2, 1)
    assert m.total_input_tokens == 150 and m.total_output_tokens == 8
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(79.0)
    assert m.errors == ["boom"]


def test_itl_pools_every_gap_and_percentiles_are_numpys():
    a, b = result(0.1, [0.01, 0.02], 3), result(0.3, [0.03, 0.04, 0.05], 4)
    m = calculate_metrics([a, b], duration_s=1.0)
    gaps = np.array([0.01, 0.02, 0.03, 0.04, 0.05]) * 1000
    assert m.itl.mean == pytest.approx(gaps.mean())
    assert m.itl.p50 == pytest.approx(30.0)
    assert m.itl.p99 == pytest.approx(np.percentile(gaps, 99))
    assert m.ttft.mean == pytest.approx(200.0)
    assert m.ttft.p50 == pytest.approx(200.0)
    assert m.e2el.percentiles[90] == pytest.approx(np.percentile([130, 420], 90))


def test_goodput_counts_requests_meeting_every_slo():
    fast = result(0.05, [0.01] * 9, 10)   # TTFT 50 ms, TPOT 10 ms
    slow_first = result(0.5, [0.01] * 9, 10)   # TTFT 500 ms
    slow_decode = result(0.05, [0.05] * 9, 10)  # TPOT 50 ms
    m = calculate_metrics([fast, slow_first, slow_decode], duration_s=2.0,
                          slo=Slo(ttft_ms=100, tpot_ms=20))
    assert m.request_goodput == pytest.approx(0.5)
    m = calculate_metrics([fast, slow_first, slow_decode], duration_s=2.0, slo=Slo(ttft_ms=100))
    assert m.request_goodput == pytest.approx(1.0)
    assert calculate_metrics([fast], duration_s=1.0).request_goodput is None


def test_slo_with_e2el_only_and_an_empty_distribution():
    assert Slo(e2el_ms=100).met_by(ttft_ms=90, tpot_ms=999, e2el_ms=100)
    assert not Slo(e2el_ms=100).met_by(ttft_ms=1, tpot_ms=1, e2el_ms=101)
    d = Distribution.of_seconds([])  # zero, not an error
    assert (d.mean, d.p50, d.p99) == (0.0, 0.0, 0.0)
