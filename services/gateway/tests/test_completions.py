"""Text completions over fake services: shapes, batches of prompts, logprobs."""

from __future__ import annotations

import json


async def test_completion_text_and_usage(gateway):
    async with gateway.client() as client:
        response = await client.post("/v1/completions",
                                     json={"model": "fake-model", "prompt": "abc"})
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    assert choice["text"] == gateway.fakes.script[:16]  # OpenAI's default max_tokens
    assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 3


async def test_batch_of_prompts_and_token_id_prompts(gateway):
    async with gateway.client() as client:
        batch = await client.post("/v1/completions", json={
            "model": "fake-model", "prompt": ["ab", "cde"], "max_tokens": 2, "n": 2})
        ids = await client.post("/v1/completions", json={
            "model": "fake-model", "prompt": [97, 98], "max_tokens": 1})
    body = batch.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 8
    assert ids.status_code == 200 and ids.json()["usage"]["prompt_tokens"] == 2


async def test_completion_logprobs_shape(gateway):
    async with gateway.client() as client:
        response = await client.post("/v1/completions", json={
            "model": "fake-model", "prompt": "x", "max_tokens": 3, "logprobs": 1})
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["H", "e", "l"]
    assert logprobs["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert logprobs["top_logprobs"] == [{"H": -0.5}, {"e": -0.5}, {"l": -0.5}]
    assert logprobs["text_offset"] == [0, 1, 2]


async def test_streaming_completion(gateway):
    body = {"model": "fake-model", "prompt": "x", "max_tokens": 3, "stream": True}
    text, finish = "", None
    async with gateway.client() as client, client.stream("POST", "/v1/completions",
                                                         json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert chunk["object"] == "text_completion" and chunk["usage"] is None
                text += chunk["choices"][0]["text"]
                finish = chunk["choices"][0]["finish_reason"] or finish
    assert text == "Hel" and finish == "length"
