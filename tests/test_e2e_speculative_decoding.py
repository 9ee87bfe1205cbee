"""Speculative decoding through the whole pipeline: behind its own gateway, an engine with
n-gram drafts (CONVEYOR_ENGINE_NUM_SPECULATIVE_TOKENS=4) answers a chat request that copies
from its prompt; the request's timeline shows the drafts verified for it and the accepted
ones, the same counts the engine's /metrics exports as vLLM's spec_decode counters."""

from __future__ import annotations

import time
import urllib.request

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devkit.ports import free_port

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
COPYING = "Repeat this list exactly: apples, oranges, pears, plums, grapes, cherries, lemons."


def _spec_decode_counts(metrics_port: int) -> tuple[float, float]:
    """The engine's vllm:spec_decode_num_draft_tokens_total and _num_accepted_tokens_total."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                  timeout=10).read().decode()
    samples = {sample.name: sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples}
    return (samples["vllm:spec_decode_num_draft_tokens_total"],
            samples["vllm:spec_decode_num_accepted_tokens_total"])


def test_a_copying_requests_drafts_reach_its_timeline_and_the_engines_metrics(launch, stack):
    metrics_port = free_port()
    [engine] = launch.engines("engine-speculative", NUM_SPECULATIVE_TOKENS="4",
                              METRICS_PORT=str(metrics_port))
    gateway = launch.gateway("gateway-speculative",
                             CONVEYOR_GATEWAY_ENGINE_ADDRESSES=engine.address)
    body = {"model": MODEL, "messages": [{"role": "user", "content": COPYING}],
            "temperature": 0, "max_tokens": 48}
    with httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=120) as client:
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        timeline = client.get(f"/v1/requests/{response.headers['x-request-id']}").json()
    drafts, accepted = timeline["num_draft_tokens"], timeline["num_accepted_draft_tokens"]
    assert 0 < accepted <= drafts, timeline
    deadline = time.monotonic() + 5  # the engine counts a step just after sending its tokens
    while (counted := _spec_decode_counts(metrics_port)) != (drafts, accepted) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert counted == (drafts, accepted)
    # Several tokens a step change nothing the caller sees: two greedy samples cut by a stop
    # string read as they do from the stack's engine, which proposes no drafts.
    stopped = {**body, "n": 2, "stop": ["plums"]}
    answers = []
    for base_url in (f"http://127.0.0.1:{gateway.port}", stack.base_url):
        with httpx.Client(base_url=base_url, timeout=120) as client:
            response = client.post("/v1/chat/completions", json=stopped)
            assert response.status_code == 200, response.text
            answers.append([(c["message"]["content"], c["finish_reason"])
                            for c in response.json()["choices"]])
    assert answers[0] == answers[1]
    assert all(reason == "stop" and "pears" in text and "plums" not in text
               for text, reason in answers[0])
