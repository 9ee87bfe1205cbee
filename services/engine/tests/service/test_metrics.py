"""Prometheus names and values, and the settings' environment prefix."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.engine_request import EngineRequest
from conveyor.engine.engine_stats import EngineStats
from conveyor.engine.iteration_stats import FinishedRequestStats, IterationStats
from conveyor.engine.metrics import EngineMetrics, one_two_five_buckets
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.settings import EngineSettings

NAMES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
         "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
         "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_bucket",
         "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
         "request_queue_time_seconds_bucket"]


def _value(metrics: EngineMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(
        f"vllm:{name}", {"model_name": "m", "engine": "e", **labels})


def test_counters_advance_by_the_difference_of_totals():
    metrics = EngineMetrics("m", "e")
    metrics.record_stats(EngineStats(num_running=2, num_free_blocks=3, num_blocks=4,
                                     prefix_cache_queries=10, prefix_cache_hits=4))
    metrics.record_stats(EngineStats(num_running=1, num_free_blocks=4, num_blocks=4,
                                     prefix_cache_queries=30, prefix_cache_hits=4,
                                     num_preemptions=1))
    assert _value(metrics, "prefix_cache_queries_total") == 30
    assert _value(metrics, "prefix_cache_hits_total") == 4
    assert _value(metrics, "num_preemptions_total") == 1
    assert _value(metrics, "num_requests_running") == 1
    assert _value(metrics, "kv_cache_usage_perc") == 0.0


def test_iteration_stats_feed_histograms():
    metrics = EngineMetrics("m", "e")
    finished = FinishedRequestStats("length", e2e_latency=1.0, queue_time=0.1, prefill_time=0.2,
                                    decode_time=0.6, num_prompt_tokens=5,
                                    num_generation_tokens=4, max_tokens=4)
    metrics.record_iteration(IterationStats(num_scheduled_tokens=6, num_prompt_tokens=5,
                                            num_generation_tokens=2, time_to_first_token=[0.2],
                                            finished=[finished]))
    assert _value(metrics, "prompt_tokens_total") == 5
    assert _value(metrics, "generation_tokens_total") == 2
    assert _value(metrics, "time_to_first_token_seconds_count") == 1
    assert _value(metrics, "e2e_request_latency_seconds_sum") == 1.0
    assert _value(metrics, "request_inference_time_seconds_sum") == pytest.approx(0.8)
    assert _value(metrics, "request_time_per_output_token_seconds_sum") == pytest.approx(0.2)
    assert _value(metrics, "request_success_total", finished_reason="length") == 1
    assert _value(metrics, "request_success_total", finished_reason="stop") == 0
    assert _value(metrics, "iteration_tokens_total_sum") == 6
    assert _value(metrics, "request_prompt_tokens_bucket", le="5.0") == 1


async def test_an_engine_run_exports_every_vllm_name(support):
    metrics = EngineMetrics("m", "e")
    engine = AsyncEngine(support.make_core(), metrics).start()
    try:
        request = EngineRequest("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3))
        [delta async for delta in engine.generate(request)]
    finally:
        engine.shutdown()
    text = generate_latest(metrics.registry).decode()
    for name in NAMES:
        assert f"vllm:{name}" in text
    assert _value(metrics, "generation_tokens_total") == 3
    assert _value(metrics, "request_queue_time_seconds_count") == 1
    assert _value(metrics, "request_success_total", finished_reason="length") == 1


def test_token_count_buckets_are_vllms():
    assert one_two_five_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


def test_settings_read_the_engine_prefix(monkeypatch):
    monkeypatch.setenv("CONVEYOR_ENGINE_BLOCK_SIZE", "32")
    monkeypatch.setenv("CONVEYOR_ENGINE_METRICS_PORT", "9102")
    monkeypatch.setenv("CONVEYOR_ENGINE_DEVICE", "cpu")
    settings = EngineSettings()
    assert (settings.block_size, settings.metrics_port, settings.port) == (32, 9102, 50052)
    from conveyor.engine.attention.native_kernel import native_unavailable_reason
    from conveyor.engine.native.cpu_features import auto_cpu_dtype

    assert settings.resolved_dtype() == auto_cpu_dtype("fp32")
    expected = "torch" if native_unavailable_reason() else "native"
    assert settings.resolved_attention_backend() == expected


def test_settings_errors_name_the_variable():
    with pytest.raises(ValueError, match="CONVEYOR_ENGINE_DTYPE"):
        EngineSettings(dtype="int3").resolved_dtype()
