"""Every error is an OpenAI error body with the right status."""

from __future__ import annotations

import json

import grpc
import pytest

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5}


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]", b"\"text\"", b"3"])
async def test_malformed_or_non_object_bodies_are_400(gateway, content):
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", content=content,
                                     headers={"content-type": "application/json"})
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("patch", "param"), [
    ({"temperature": 5}, "temperature"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_logprobs": 3}, None),
    ({"n": 99}, "n"),
    ({"logit_bias": {"5000": 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, None),
])
async def test_invalid_parameters_are_400_naming_the_parameter(gateway, patch, param):
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", json={**CHAT, **patch})
    assert error_of(response, 400)["param"] == param


async def test_missing_field_of_completions_is_400(gateway):
    async with gateway.client() as client:
        response = await client.post("/v1/completions", json={"model": "fake-model"})
    assert error_of(response, 400)["param"] == "prompt"


async def test_unknown_model_is_404(gateway):
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
    error = error_of(response, 404)
    assert error["param"] == "model" and error["code"] == "model_not_found"


async def test_context_length_exceeded_names_both_numbers(gateway):
    async with gateway.client() as client:
        chat = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 500})
        completion = await client.post("/v1/completions", json={
            "model": "fake-model", "prompt": "x" * 200, "max_tokens": 1})
    error = error_of(chat, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "128" in error["message"] and "500" in error["message"]
    error = error_of(completion, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"


async def test_prompt_filling_the_context_without_max_tokens_is_400(gateway):
    async with gateway.client() as client:
        response = await client.post("/v1/completions", json={
            "model": "fake-model", "prompt": "x" * 128, "max_tokens": None})
    assert error_of(response, 400)["code"] == "context_length_exceeded"


async def test_the_context_length_checked_is_the_one_the_engine_publishes(gateway_factory, fakes):
    """The engine serves 64 of the model's 128 positions (the tokenizer is told nothing by
    hand): a prompt that fits 128 but not 64 is 400, and the defaults follow 64."""
    fakes.engine.max_model_len = 64
    gateway = await gateway_factory()
    async with gateway.client() as client:
        models = (await client.get("/v1/models")).json()
        refused = await client.post("/v1/completions", json={
            "model": "fake-model", "prompt": "x" * 60, "max_tokens": 10})
        filled = await client.post("/v1/completions", json={
            "model": "fake-model", "prompt": "x" * 60, "max_tokens": None})
    assert models["data"][0]["max_model_len"] == 64
    error = error_of(refused, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "maximum context length is 64 tokens" in error["message"]
    assert filled.status_code == 200 and fakes.engine.requests[-1].sampling.max_tokens == 4


async def test_no_reachable_engine_is_503_with_retry_after(gateway_factory):
    gateway = await gateway_factory(engine_addresses="127.0.0.1:1", retry_after_s=3)
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", json=CHAT)
        health = await client.get("/health")
    error = error_of(response, 503)
    assert response.headers["retry-after"] == "3"
    assert error["code"] == "no_engine_available"
    assert health.status_code == 503 and health.json()["down"] == ["engine"]


async def test_engine_rejecting_before_output_is_an_http_error(gateway):
    engine = gateway.fakes.engine
    engine.fail_after, engine.fail_code = 0, grpc.StatusCode.INVALID_ARGUMENT
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert error_of(response, 400)["message"] == "fake engine failure"


async def test_engine_fault_is_500(gateway):
    gateway.fakes.engine.fail_after = 0
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", json=CHAT)
    assert error_of(response, 500)["code"] == "internal_error"


async def test_error_after_the_stream_started_is_an_error_event_then_done(gateway):
    gateway.fakes.engine.fail_after, gateway.fakes.engine.delay_s = 2, 0.05
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 200
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert error["code"] == "internal_error" and set(error) == {"message", "type", "param",
                                                                "code"}
    text = "".join(json.loads(x)["choices"][0]["delta"].get("content", "")
                   for x in lines[:-2])
    assert text in ("H", "He")  # what detok answered before the engine failed


async def test_unknown_route_is_an_openai_404(gateway):
    async with gateway.client() as client:
        response = await client.get("/v1/nothing")
        wrong_method = await client.get("/v1/completions")
    error = error_of(response, 404)
    assert (error["type"], error["message"]) == ("not_found_error",
                                                 "Invalid URL (GET /v1/nothing): Not Found")
    assert error_of(wrong_method, 405)["message"] == (
        "Invalid URL (GET /v1/completions): Method Not Allowed")


async def test_draining_gateway_refuses_with_503(gateway):
    gateway.pipeline.draining = True
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", json=CHAT)
        health = await client.get("/health")
    assert error_of(response, 503) and response.headers["retry-after"] == "1"
    assert health.status_code == 503
