"""A generation whose engine fails mid-stream moves to another engine (fake engines,
real Redis): the client's stream goes on with the rest of the text and no error, the
new engine is given the tokens so far as output already produced, and the timeline
counts the move; with no moves allowed the client gets the error event."""

from __future__ import annotations

import json

import grpc

from conveyor.common.engine_registry import EngineEntry, EngineLoad, EngineRegistry

SCRIPT_PREFIX = "Hello th"  # the fake engine's first 8 characters
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8, "stream": True}


async def _two_engines(gateway_factory, redis, prefix, **settings):
    gateway = await gateway_factory(engine_addresses="", **settings)
    registry = EngineRegistry(redis, prefix=prefix)
    for engine_id in ("a", "b"):  # two ids, one fake server: what matters is the id
        await registry.heartbeat(EngineEntry(engine_id, gateway.fakes.address("engine"),
                                             "fake-model", EngineLoad()))
    engine = gateway.fakes.engine
    engine.fail_after, engine.fail_code, engine.fail_once = 3, grpc.StatusCode.UNAVAILABLE, True
    engine.delay_s = 0.1  # the first token is out long before the failure
    return gateway


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def test_a_stream_whose_engine_fails_goes_on_on_another(gateway_factory, redis, prefix):
    gateway = await _two_engines(gateway_factory, redis, prefix)
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", json=CHAT)
        events = _events(response.text)
        timeline = (await client.get(f"/v1/requests/{response.headers['x-request-id']}")).json()
    assert not [e for e in events if "error" in e]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert text == SCRIPT_PREFIX and events[-1]["choices"][0]["finish_reason"] == "length"
    first, resumed = gateway.fakes.engine.requests
    assert list(resumed.resume_output_token_ids) == [ord(c) for c in SCRIPT_PREFIX[:3]]
    assert resumed.prompt_token_ids == first.prompt_token_ids
    assert resumed.sampling.max_tokens == first.sampling.max_tokens == 8
    assert timeline["num_moves"] == 1 and timeline["engine_id"] in ("a", "b")
    # 2 drafts and 1 accepted per token (fakes.FakeEngine): both engines' counts
    assert (timeline["num_draft_tokens"], timeline["num_accepted_draft_tokens"]) == (16, 8)


async def test_with_no_moves_allowed_the_client_gets_the_error_event(gateway_factory, redis,
                                                                     prefix):
    gateway = await _two_engines(gateway_factory, redis, prefix, max_stream_moves=0)
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", json=CHAT)
    errors = [e["error"] for e in _events(response.text) if "error" in e]
    assert len(errors) == 1 and "unavailable" in errors[0]["message"], [
        list(r.resume_output_token_ids) for r in gateway.fakes.engine.requests]
    assert len(gateway.fakes.engine.requests) == 1


async def test_the_samples_of_a_shared_stream_move_together_each_alone(gateway_factory, redis,
                                                                       prefix):
    gateway = await _two_engines(gateway_factory, redis, prefix, max_stream_moves=1)
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions",
                                     json={**CHAT, "n": 3, "seed": 7})
        events = _events(response.text)
        timeline = (await client.get(f"/v1/requests/{response.headers['x-request-id']}")).json()
    assert not [e for e in events if "error" in e]
    texts = {i: "" for i in range(3)}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
    assert texts == {i: SCRIPT_PREFIX for i in range(3)}
    shared, *resumed = gateway.fakes.engine.requests
    assert shared.n == 3 and shared.sampling.seed == 7
    # Each sample goes on alone (n = 1) with its own tokens and seed, all in one move.
    assert sorted((r.n, r.sampling.seed) for r in resumed) == [(1, 7), (1, 8), (1, 9)]
    assert all(list(r.resume_output_token_ids) == [ord(c) for c in SCRIPT_PREFIX[:3]]
               for r in resumed)
    assert len({r.request_id for r in resumed}) == 3
    assert timeline["num_moves"] == 1
    assert (timeline["num_draft_tokens"], timeline["num_accepted_draft_tokens"]) == (48, 24)
