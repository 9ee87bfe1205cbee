"""A real engine process's /metrics, scraped after it served requests: every vllm: name
vLLM's engine exports, with vLLM's type, its labels (model_name, engine; finished_reason
on request_success) and, for the latency histograms, vLLM's buckets."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conveyor.v1 import engine_pb2, engine_pb2_grpc
from devkit.ports import free_port

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
LABELS = {"model_name", "engine"}
EXPECTED = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:cache_config_info": "gauge",
}


@pytest.fixture(scope="module")
def scraped(module_launch) -> dict:
    """The families of an engine's /metrics after two requests (length, then stop)."""
    port = free_port()
    [engine] = module_launch.engines("vllm-metrics", METRICS_PORT=str(port))

    async def serve_two() -> None:
        async with grpc.aio.insecure_channel(engine.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            for request_id, max_tokens, prompt in (("a", 6, [1, 504, 3458, 282]),
                                                   ("b", 6, [1, 504, 3458, 282, 4649])):
                request = engine_pb2.GenerateRequest(
                    request_id=request_id, prompt_token_ids=prompt,
                    sampling=engine_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens))
                async for _ in stub.Generate(request):
                    pass

    asyncio.run(serve_two())
    # The loop records a step's counters after it hands out the step's tokens: wait (with a
    # deadline) for the last step to be counted, both requests finished, before reading.
    deadline = time.monotonic() + 10
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                      timeout=10).read().decode()
        families = {family.name: family for family in text_string_to_metric_families(text)
                    if family.name.startswith(("vllm:", "conveyor:"))}
        finished = sum(s.value for s in families["vllm:request_success"].samples
                       if s.name == "vllm:request_success_total")
        if finished >= 2 or time.monotonic() > deadline:
            return families
        time.sleep(0.05)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_vllm_metric_has_vllms_type_and_labels(scraped, name):
    family = scraped[name]
    assert family.type == EXPECTED[name]
    labels = set().union(*(set(sample.labels) for sample in family.samples)) - {"le"}
    if name == "vllm:cache_config_info":
        assert {"block_size", "num_gpu_blocks", "engine"} <= labels
        return
    expected = LABELS | ({"finished_reason"} if name == "vllm:request_success" else set())
    assert labels == expected
    assert {s.labels["model_name"] for s in family.samples} == {MODEL}
    assert {s.labels["engine"] for s in family.samples} == {"vllm-metrics"}


def test_they_counted_what_the_engine_did(scraped):
    def value(name: str, suffix: str = "", **labels: str) -> float:
        return sum(s.value for s in scraped[name].samples if s.name == name + suffix
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("vllm:generation_tokens", "_total") == 12
    assert value("vllm:request_success", "_total", finished_reason="length") == 2
    assert value("vllm:request_success", "_total", finished_reason="stop") == 0
    assert value("vllm:prompt_tokens", "_total") == 9
    assert value("vllm:e2e_request_latency_seconds", "_count") == 2
    assert value("vllm:inter_token_latency_seconds", "_count") == 10
    assert value("vllm:prefix_cache_queries", "_total") >= 9


VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                                40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
"""vLLM's buckets (vllm/v1/metrics/loggers.py), spelled out."""


@pytest.mark.parametrize(("name", "buckets"), [
    ("vllm:time_to_first_token_seconds", VLLM_TTFT_BUCKETS),
    ("vllm:e2e_request_latency_seconds", VLLM_REQUEST_LATENCY_BUCKETS)])
def test_latency_buckets_are_vllms(scraped, name, buckets):
    edges = sorted({float(s.labels["le"]) for s in scraped[name].samples
                    if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"})
    assert edges == buckets
