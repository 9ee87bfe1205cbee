"""Each error case over the real pipeline, with its status and OpenAI error body."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.fixture
def http(stack):
    with httpx.Client(base_url=stack.base_url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("content", [b"{\"model\": ", b"[]", b"42"])
def test_malformed_json_and_non_objects_are_400(http, content):
    response = http.post("/v1/chat/completions", content=content,
                         headers={"content-type": "application/json"})
    assert error_of(response, 400)["type"] == "invalid_request_error"


def test_out_of_range_parameter_is_400_naming_it(http):
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "a",
                                                  "top_p": 1.5})
    assert error_of(response, 400)["param"] == "top_p"


def test_unknown_model_is_404(http):
    error = error_of(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-7"}), 404)
    assert error["param"] == "model" and error["code"] == "model_not_found"


def test_context_length_exceeded_is_400_with_both_numbers(http):
    response = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5000})
    error = error_of(response, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "2048" in error["message"] and "5000" in error["message"]


def test_context_length_with_the_openai_client(openai_client):
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.completions.create(model=MODEL, prompt="hi", max_tokens=4096)
    assert caught.value.status_code == 400
    assert caught.value.body["code"] == "context_length_exceeded"


def test_models_lists_max_model_len(openai_client, http):
    [model] = openai_client.models.list().data
    assert model.id == MODEL
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 2048


def test_a_registered_engines_max_model_len_is_checked_without_a_setting_elsewhere(
        launch, stack):
    """An engine of max_model_len 512 (the model has 8192 positions) registers; a gateway
    routing over it refuses a prompt past 512 that the model would take, though neither it
    nor the tokenizer was told 512."""
    prefix = f"{stack.redis_prefix}:short-context"
    launch.engines("engine-512", MAX_MODEL_LEN="512", REDIS_PREFIX=prefix)
    gateway = launch.gateway("gateway-512", CONVEYOR_GATEWAY_REDIS_PREFIX=prefix)
    with httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=60) as client:
        models = client.get("/v1/models").json()
        refused = client.post("/v1/completions", json={
            "model": MODEL, "prompt": [5] * 600, "max_tokens": 4})
        served = client.post("/v1/completions", json={
            "model": MODEL, "prompt": [5] * 500, "max_tokens": 4})
    assert models["data"][0]["max_model_len"] == 512
    error = error_of(refused, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "max_model_len 512" in error["message"]
    assert served.status_code == 200, served.text


def test_no_engine_is_503_with_retry_after(extra_gateway):
    gateway = extra_gateway(CONVEYOR_GATEWAY_ENGINE_ADDRESSES="127.0.0.1:9",
                            CONVEYOR_GATEWAY_RETRY_AFTER_S="2")
    with httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=30) as client:
        response = client.post("/v1/chat/completions", json=CHAT)
        health = client.get("/health")
    error = error_of(response, 503)
    assert response.headers["retry-after"] == "2" and error["code"] == "no_engine_available"
    assert health.status_code == 503


def test_health_ok_and_tokenize_round_trip(http):
    assert http.get("/health").json()["status"] == "ok"
    tokens = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world",
                                          "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["token_strs"][-2:] == ["Hello", "Ġworld"]
    text = http.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()
    assert text["prompt"].endswith("Hello world")


async def test_a_failure_after_the_stream_started_is_an_error_event_then_done(
        spare_detok, extra_gateway, idle_engine):
    gateway = extra_gateway(CONVEYOR_GATEWAY_DETOK_ADDRESS=spare_detok.address)
    body = {**CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    lines = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}",
                                 timeout=60) as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[len("data: "):])
                if len(lines) == 3:
                    spare_detok.kill()
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "service_unavailable" and "detok" in error["message"]
    stats = await idle_engine(30.0)  # the engine stream was cancelled with it
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks
