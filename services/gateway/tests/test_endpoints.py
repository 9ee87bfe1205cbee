"""The small endpoints: models, tokenize, detokenize, health, metrics."""

from __future__ import annotations


async def test_models_lists_the_served_model_with_its_context_length(gateway):
    async with gateway.client() as client:
        body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    [model] = body["data"]
    assert model["id"] == "fake-model" and model["max_model_len"] == 128


async def test_served_model_name_setting_wins(gateway_factory):
    gateway = await gateway_factory(served_model_name="house-model")
    async with gateway.client() as client:
        models = (await client.get("/v1/models")).json()
        ok = await client.post("/v1/completions", json={"model": "house-model", "prompt": "a",
                                                        "max_tokens": 1})
    assert models["data"][0]["id"] == "house-model" and ok.status_code == 200


async def test_tokenize_and_detokenize(gateway):
    async with gateway.client() as client:
        tokens = (await client.post("/tokenize", json={"prompt": "ab"})).json()
        chat = (await client.post("/tokenize", json={
            "messages": [{"role": "user", "content": "x"}]})).json()
        text = (await client.post("/detokenize", json={"tokens": [104, 105]})).json()
        bad = await client.post("/tokenize", json={"model": "other", "prompt": "a"})
        strings = (await client.post("/tokenize", json={"prompt": "ab",
                                                        "return_token_strs": True})).json()
    assert tokens == {"count": 2, "max_model_len": 128, "tokens": [97, 98], "token_strs": None}
    assert strings["token_strs"] == ["<97>", "<98>"]
    assert chat["count"] == len("user:x\nassistant:")
    assert text == {"prompt": "hi"}
    assert bad.status_code == 404


async def test_health_is_ok_with_every_service_up(gateway):
    async with gateway.client() as client:
        response = await client.get("/health")
    assert response.status_code == 200 and response.json() == {"status": "ok", "num_engines": 1}


async def test_metrics_count_requests_and_latency(gateway):
    async with gateway.client() as client:
        await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        text = (await client.get("/metrics")).text
    assert 'conveyor_gateway_requests_total{endpoint="completions",status="200"} 1.0' in text
    assert "conveyor_gateway_request_duration_seconds_bucket" in text
    assert "conveyor_gateway_client_disconnects_total" in text
    assert "conveyor_gateway_completion_tokens_total 2.0" in text
