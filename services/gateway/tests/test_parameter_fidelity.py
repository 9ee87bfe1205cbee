"""Every accepted field is honoured, has no effect by its own definition, or is refused
with a 400 naming it (fake services, real Redis)."""

from __future__ import annotations

import json

import pytest

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3}
COMPLETION = {"model": "fake-model", "prompt": "abc", "max_tokens": 3}


async def _post(gateway, path: str, body: dict):
    async with gateway.client() as client:
        return await client.post(path, json=body)


def _refusal(response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


async def test_a_field_in_no_schema_is_refused_by_name(gateway):
    error = _refusal(await _post(gateway, "/v1/chat/completions", {**CHAT, "temprature": 1}))
    assert error["param"] == "temprature"
    assert error["message"] == "Unrecognized request argument supplied: temprature"
    error = _refusal(await _post(gateway, "/v1/completions", {**COMPLETION, "metadata": {}}))
    assert error["param"] == "metadata"  # a chat field, in no completions schema
    assert not gateway.fakes.engine.requests


@pytest.mark.parametrize(("field", "value"), [
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}),
    ("moderation", {"model": "omni-moderation-latest"}),
    ("prompt_cache_options", {"mode": "explicit"}),
    ("modalities", ["text", "audio"]),
    ("prompt_cache_retention", "24h"),
])
async def test_chat_fields_that_cannot_be_honoured_are_refused(gateway, field, value):
    error = _refusal(await _post(gateway, "/v1/chat/completions", {**CHAT, field: value}))
    assert (error["param"], error["code"]) == (field, "unsupported_parameter")
    assert error["message"].startswith(f"{field} is not supported: ")


@pytest.mark.parametrize(("field", "value"), [
    ("audio", None), ("functions", None), ("store", False), ("modalities", ["text"]),
    ("prompt_cache_retention", "in_memory"), ("reasoning_effort", "high"),
    ("verbosity", "low"), ("safety_identifier", "user-42"), ("service_tier", "auto"),
    ("prompt_cache_key", "k"), ("metadata", {"a": "b"}),
])
async def test_chat_fields_without_effect_or_left_unset_are_served(gateway, field, value):
    response = await _post(gateway, "/v1/chat/completions", {**CHAT, field: value})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("body", "param"), [
    ({"suffix": "end"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"echo": True, "logprobs": 1, "stream": True, "n": 2}, "echo"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
async def test_completion_fields_that_cannot_be_honoured_are_refused(gateway, body, param):
    error = _refusal(await _post(gateway, "/v1/completions", {**COMPLETION, **body}))
    assert error["param"] == param


async def test_best_of_equal_to_n_returns_every_candidate(gateway):
    response = await _post(gateway, "/v1/completions", {**COMPLETION, "n": 2, "best_of": 2})
    assert len(response.json()["choices"]) == 2


async def test_message_fields_are_checked_too(gateway):
    messages = [{"role": "assistant", "content": None, "audio": {"id": "a1"}}]
    error = _refusal(await _post(gateway, "/v1/chat/completions", {**CHAT, "messages": messages}))
    assert error["param"] == "messages.0.audio"
    messages = [{"role": "user", "content": "hi", "colour": "red"}]
    error = _refusal(await _post(gateway, "/v1/chat/completions", {**CHAT, "messages": messages}))
    assert error["param"] == "messages.0.colour"


async def test_an_earlier_refusal_fed_back_is_rendered_as_its_text(gateway):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "refusal": "I cannot", "annotations": []},
                {"role": "user", "content": "why"}]
    response = await _post(gateway, "/v1/chat/completions", {**CHAT, "messages": messages})
    assert response.status_code == 200, response.text
    [request] = gateway.fakes.engine.requests
    assert "assistant:I cannot\n" in "".join(chr(t) for t in request.prompt_token_ids)


async def test_metadata_and_safety_identifier_are_kept_on_the_timeline(gateway):
    body = {**CHAT, "metadata": {"team": "search", "run": "7"}, "safety_identifier": "u-1"}
    response = await _post(gateway, "/v1/chat/completions", body)
    async with gateway.client() as client:
        timeline = (await client.get(f"/v1/requests/{response.headers['x-request-id']}")).json()
    assert timeline["metadata"] == {"team": "search", "run": "7"}
    assert timeline["safety_identifier"] == "u-1"


async def test_metadata_is_bounded_as_openais(gateway):
    too_many = {f"k{i}": "v" for i in range(17)}
    assert _refusal(await _post(gateway, "/v1/chat/completions",
                                {**CHAT, "metadata": too_many}))["param"] == "metadata"


@pytest.mark.parametrize(("tier", "priority", "served"), [
    ("flex", 10 + 9, "flex"), ("priority", 10, "default"), ("default", 10, "default")])
async def test_service_tier_picks_the_priority_band_and_is_echoed(gateway, tier, priority,
                                                                  served):
    response = await _post(gateway, "/v1/chat/completions", {**CHAT, "service_tier": tier})
    [request] = gateway.fakes.engine.requests
    assert request.priority == priority  # the anonymous tenant's tier "unlimited": 10
    assert response.json()["service_tier"] == served


async def test_prompt_cache_key_is_the_routing_session_key(gateway, redis, prefix):
    await _post(gateway, "/v1/chat/completions", {**CHAT, "prompt_cache_key": "shared-doc"})
    keys = [key async for key in redis.scan_iter(match=f"{prefix}:route:*")]
    assert any(key.endswith(":shared-doc") for key in keys), keys


async def test_continuous_usage_stats_put_usage_on_every_chunk(gateway):
    body = {**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True,
                                                        "include_usage": True}}
    chunks = _chunks((await _post(gateway, "/v1/chat/completions", body)).text)
    prompt_tokens = len("user:hi\nassistant:")
    usages = [c["usage"] for c in chunks]
    assert all(u is not None and u["prompt_tokens"] == prompt_tokens for u in usages)
    counts = [u["completion_tokens"] for u in usages]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-2] == 3  # so far, each
    assert chunks[-1]["choices"] == [] and counts[-1] == 3


async def test_include_obfuscation_pads_content_chunks(gateway):
    body = {**CHAT, "stream": True, "stream_options": {"include_obfuscation": True}}
    chunks = _chunks((await _post(gateway, "/v1/chat/completions", body)).text)
    padded = [c for c in chunks if c["choices"][0]["delta"].get("content")]
    assert padded and all(
        (len(c["choices"][0]["delta"]["content"]) + len(c["obfuscation"])) % 32 == 0
        for c in padded)


async def test_echo_puts_the_prompt_before_each_choice(gateway):
    body = {**COMPLETION, "echo": True, "n": 2}
    choices = (await _post(gateway, "/v1/completions", body)).json()["choices"]
    assert [c["text"] for c in choices] == ["abcHel", "abcHel"]
    [request] = gateway.fakes.engine.requests
    assert not request.sampling.HasField("prompt_logprobs")  # no logprobs: none computed


async def test_echo_with_logprobs_shows_the_prompts_logprobs_first(gateway):
    body = {**COMPLETION, "echo": True, "logprobs": 1}
    [choice] = (await _post(gateway, "/v1/completions", body)).json()["choices"]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == list("abcHel")
    assert logprobs["token_logprobs"][:3] == [None, pytest.approx(-0.1), pytest.approx(-0.2)]
    assert logprobs["top_logprobs"][0] is None and logprobs["top_logprobs"][1] == {"c": -0.5}
    assert logprobs["text_offset"] == [0, 1, 2, 3, 4, 5]
    assert "prompt_logprobs" not in choice  # not asked for by name


async def test_streamed_echo_starts_the_first_chunk_with_the_prompt(gateway):
    body = {**COMPLETION, "echo": True, "logprobs": 0, "stream": True}
    chunks = _chunks((await _post(gateway, "/v1/completions", body)).text)
    first = chunks[0]["choices"][0]
    assert first["text"] == "abcH"
    assert first["logprobs"]["tokens"] == list("abcH")
    assert first["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abcHel"


async def test_echo_of_token_ids_shows_their_text(gateway):
    body = {**COMPLETION, "prompt": [120, 121], "echo": True}
    [choice] = (await _post(gateway, "/v1/completions", body)).json()["choices"]
    assert choice["text"] == "xyHel"


async def test_prompt_logprobs_in_vllms_completion_shape(gateway):
    body = {**COMPLETION, "prompt_logprobs": 1}
    [choice] = (await _post(gateway, "/v1/completions", body)).json()["choices"]
    assert choice["prompt_logprobs"] == [
        None,
        {str(ord("b")): {"logprob": pytest.approx(-0.1), "rank": 1, "decoded_token": "b"},
         str(ord("c")): {"logprob": -0.5, "rank": 1, "decoded_token": "c"}},
        {str(ord("c")): {"logprob": pytest.approx(-0.2), "rank": 2, "decoded_token": "c"},
         str(ord("d")): {"logprob": -0.5, "rank": 1, "decoded_token": "d"}},
    ]


async def test_prompt_logprobs_in_vllms_chat_shape(gateway):
    response = (await _post(gateway, "/v1/chat/completions", {**CHAT, "prompt_logprobs": 0})).json()
    prompt = "user:hi\nassistant:"
    entries = response["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    assert entries[1] == {str(ord("s")): {"logprob": pytest.approx(-0.1), "rank": 1,
                                          "decoded_token": "s"}}
    [request] = gateway.fakes.engine.requests
    assert request.sampling.prompt_logprobs == 0


async def test_models_retrieve(gateway):
    async with gateway.client() as client:
        found = await client.get("/v1/models/fake-model")
        missing = await client.get("/v1/models/other/model")
    assert found.json()["id"] == "fake-model" and found.json()["object"] == "model"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def _chunks(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]  # the fake tokenizer's ids


async def test_return_token_ids_in_vllms_chat_shape(gateway):
    body = {**CHAT, "n": 2, "return_token_ids": True}
    response = (await _post(gateway, "/v1/chat/completions", body)).json()
    assert response["prompt_token_ids"] == _ids("user:hi\nassistant:")
    assert [c["token_ids"] for c in response["choices"]] == [_ids("Hel")] * 2
    chunks = _chunks((await _post(gateway, "/v1/chat/completions",
                                  {**body, "stream": True, "stop": ["zzz"]})).text)
    assert chunks[0]["prompt_token_ids"] == response["prompt_token_ids"]
    assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])
    streamed = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            streamed[choice["index"]] += choice.get("token_ids", [])
    assert streamed == {0: _ids("Hel"), 1: _ids("Hel")}
    plain = (await _post(gateway, "/v1/chat/completions", CHAT)).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


async def test_return_token_ids_in_vllms_completion_shape(gateway):
    body = {**COMPLETION, "prompt": ["abc", "de"], "return_token_ids": True}
    choices = (await _post(gateway, "/v1/completions", body)).json()["choices"]
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in choices] == [
        (_ids("abc"), _ids("Hel")), (_ids("de"), _ids("Hel"))]
    # a stop string holds text back: a delta whose tokens made no text yet still shows them
    chunks = _chunks((await _post(gateway, "/v1/completions",
                                  {**body, "stream": True, "stop": ["zzz"]})).text)
    assert any(c["choices"][0]["text"] == "" and c["choices"][0]["token_ids"] for c in chunks)
    prompts, streamed = {}, {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            assert choice["index"] not in prompts or "prompt_token_ids" not in choice
            prompts.setdefault(choice["index"], choice.get("prompt_token_ids"))
            streamed[choice["index"]] += choice["token_ids"]
    assert prompts == {0: _ids("abc"), 1: _ids("de")}  # in each choice's first chunk
    assert streamed == {0: _ids("Hel"), 1: _ids("Hel")}


@pytest.mark.parametrize("words", [["w"] * 65, [""], ["x" * 513]])
async def test_bad_words_past_their_bounds_are_refused(gateway, words):
    error = _refusal(await _post(gateway, "/v1/completions", {**COMPLETION, "bad_words": words}))
    assert error["param"].startswith("bad_words")


async def test_truncate_prompt_tokens_of_zero_is_refused(gateway):
    error = _refusal(await _post(gateway, "/v1/chat/completions",
                                 {**CHAT, "truncate_prompt_tokens": 0}))
    assert error["param"] == "truncate_prompt_tokens"


async def test_allowed_token_ids_go_to_the_engine_and_an_empty_list_is_refused(gateway):
    served = await _post(gateway, "/v1/completions", {**COMPLETION, "allowed_token_ids": [72, 9]})
    assert served.status_code == 200, served.text
    [request] = gateway.fakes.engine.requests
    assert list(request.sampling.allowed_token_ids) == [72, 9]
    for ids in ([], [10**6], [1] * 10**5):  # none, outside the vocabulary, more than it holds
        error = _refusal(await _post(gateway, "/v1/completions",
                                     {**COMPLETION, "allowed_token_ids": ids}))
        assert error["param"] == "allowed_token_ids"


async def test_return_tokens_as_token_ids_names_every_logprob_token_by_id(gateway):
    body = {**CHAT, "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}
    [choice] = (await _post(gateway, "/v1/chat/completions", body)).json()["choices"]
    first = choice["logprobs"]["content"][0]
    assert first["token"] == "token_id:72" and first["bytes"] == list(b"token_id:72")
    assert all(t["token"].startswith("token_id:") for t in first["top_logprobs"])
    chunks = _chunks((await _post(gateway, "/v1/completions", {
        **COMPLETION, "logprobs": 1, "stream": True, "return_tokens_as_token_ids": True})).text)
    tokens = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert tokens == ["token_id:72", "token_id:101", "token_id:108"]


async def test_chat_echo_puts_the_continued_assistant_turn_before_the_content(gateway):
    body = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "Yo, "}],
            "continue_final_message": True, "add_generation_prompt": False, "echo": True}
    [choice] = (await _post(gateway, "/v1/chat/completions", body)).json()["choices"]
    assert choice["message"]["content"] == "Yo, Hel"
    chunks = _chunks((await _post(gateway, "/v1/chat/completions",
                                  {**body, "stream": True})).text)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Yo, Hel"
    plain = (await _post(gateway, "/v1/chat/completions", {**CHAT, "echo": True})).json()
    assert plain["choices"][0]["message"]["content"] == "Hel"  # the last turn is the user's
