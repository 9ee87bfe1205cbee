"""Chat completions over fake services: response shapes, streaming, n, parameters."""

from __future__ import annotations

import json

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


async def sse_events(client, body: dict) -> list:
    """The decoded `data:` payloads of a streaming request, [DONE] as the string."""
    events = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_non_streaming_response_shape_and_usage(gateway):
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert response.headers["x-request-id"] == body["id"]
    assert body["model"] == "fake-model"
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": gateway.fakes.script[:5]}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    prompt_tokens = len("user:hi\nassistant:")
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens, "completion_tokens": 5,
        "total_tokens": prompt_tokens + 5, "prompt_tokens_details": {"cached_tokens": 3},
    }


async def test_streaming_chunks_then_usage_chunk_then_done(gateway):
    body = {**CHAT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    async with gateway.client() as client:
        events = await sse_events(client, body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == gateway.fakes.script[:4]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


async def test_n_choices_are_one_engine_call_split_by_index(gateway):
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions",
                                     json={**CHAT, "max_tokens": 3, "n": 3, "seed": 7})
        events = await sse_events(client, {**CHAT, "max_tokens": 3, "n": 2, "stream": True})
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == [gateway.fakes.script[:3]] * 3
    assert body["usage"]["completion_tokens"] == 9
    assert body["usage"]["prompt_tokens"] == len("user:hi\nassistant:")  # once, as OpenAI
    one_call, streamed_call = gateway.fakes.engine.requests
    assert (one_call.n, one_call.sampling.seed, streamed_call.n) == (3, 7, 2)
    streamed = {0: "", 1: ""}
    for event in events[:-1]:
        for choice in event["choices"]:
            streamed[choice["index"]] += choice["delta"].get("content", "")
    assert streamed == {0: gateway.fakes.script[:3], 1: gateway.fakes.script[:3]}


async def test_stop_string_ends_text_before_it_and_cancels_the_engine(gateway, wait_until):
    gateway.fakes.engine.delay_s = 0.01
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions",
                                     json={**CHAT, "max_tokens": 40, "stop": ["friend"]})
        included = await client.post("/v1/chat/completions", json={
            **CHAT, "max_tokens": 40, "stop": "friend", "include_stop_str_in_output": True})
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == "Hello there, "
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "friend"
    assert included.json()["choices"][0]["message"]["content"] == "Hello there, friend"
    await wait_until(lambda: len(gateway.fakes.engine.cancelled) == 2)
    assert response.json()["usage"]["completion_tokens"] == len("Hello there, friend")


async def test_sampling_parameters_reach_the_engine(gateway):
    body = {**CHAT, "max_tokens": 9, "max_completion_tokens": 2, "temperature": 0.5,
            "top_p": 0.9, "top_k": 5, "min_p": 0.1, "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {"65": 10},
            "stop_token_ids": [3], "ignore_eos": True, "priority": 2, "min_tokens": 1,
            "user": "someone"}
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    [request] = gateway.fakes.engine.requests
    s = request.sampling
    assert (s.max_tokens, s.top_k, s.ignore_eos, s.min_tokens) == (2, 5, True, 1)
    assert abs(s.temperature - 0.5) < 1e-6 and abs(s.top_p - 0.9) < 1e-6
    assert abs(s.repetition_penalty - 1.2) < 1e-6 and abs(s.min_p - 0.1) < 1e-6
    assert dict(s.logit_bias) == {65: 10.0} and list(s.stop_token_ids) == [3]
    # priority is an offset from the tier's (the anonymous tenant's "unlimited": 10)
    assert request.priority == 12 and not s.HasField("seed")


async def test_default_max_tokens_is_what_the_context_has_left(gateway):
    async with gateway.client() as client:
        await client.post("/v1/chat/completions", json={**CHAT, "stop": "."})
    [request] = gateway.fakes.engine.requests
    prompt_len = len("user:hi\nassistant:")
    assert request.sampling.max_tokens == gateway.fakes.max_model_len - prompt_len


async def test_logprobs_in_openai_chat_shape(gateway):
    body = {**CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", json=body)
        events = await sse_events(client, {**body, "stream": True})
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == ["H", "e"]
    assert content[0]["logprob"] == -0.5 and content[0]["bytes"] == [72]
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["H", "I"]
    streamed = [e["choices"][0]["logprobs"] for e in events[1:-1] if e["choices"]]
    assert [entry["token"] for lp in streamed if lp for entry in lp["content"]] == ["H", "e"]


async def test_no_logprobs_means_no_decode_calls(gateway, monkeypatch):
    calls = []
    tokenizer = gateway.pipeline.tokenizer
    original = tokenizer.decode

    async def counting_decode(*args, **kwargs):
        calls.append(args)
        return await original(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "decode", counting_decode)
    async with gateway.client() as client:
        await sse_events(client, {**CHAT, "max_tokens": 3, "stream": True})
    assert calls == []


async def test_logprob_texts_come_from_detok_with_no_decode_call(gateway):
    body = {**CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    echo = {"model": "fake-model", "prompt": "hi", "max_tokens": 2, "echo": True, "logprobs": 1}
    async with gateway.client() as client:
        whole = (await client.post("/v1/chat/completions",
                                   json={**body, "prompt_logprobs": 1})).json()
        events = await sse_events(client, {**body, "stream": True})
        echoed = (await client.post("/v1/completions", json=echo)).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in content] == [
        ("H", ["H", "I"]), ("e", ["e", "f"]), ("l", ["l", "m"])]
    assert [next(iter(e.values()))["decoded_token"] for e in whole["prompt_logprobs"][1:4]] \
        == ["s", "e", "r"]  # "user:hi\n...": each prompt token's own text first
    streamed = [e["choices"][0]["logprobs"] for e in events[1:-1] if e["choices"]]
    assert [entry["token"] for lp in streamed if lp for entry in lp["content"]] == ["H", "e", "l"]
    assert echoed["choices"][0]["logprobs"]["tokens"] == ["h", "i", "H", "e"]
    assert gateway.fakes.tokenizer.decodes == []  # detok sent the texts
