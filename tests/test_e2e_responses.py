"""The Responses API end to end with the official openai SDK: real processes, the real
model, the real Redis.

- create, plain and streamed (the events iterate; output_text is the deltas joined);
- a function tool (tool_choice required, so the 135M model calls it): a function_call
  item streamed with its argument deltas, then a turn answering it with
  function_call_output through previous_response_id;
- text.format json_schema: the output parses and validates;
- a three-turn previous_response_id chain whose prompts reuse the prefix cache
  (cached tokens reported);
- a conversation (the Conversations API): its items read before the input (the prompt the
  engine got counted by /tokenize), the turn added to it, then the conversation deleted;
- truncation "auto": a conversation past the context is served from its last turn that fits
  (the prompt the engine got counted by /tokenize), refused without it;
- another tenant's key gets 404 for a stored response's id;
- background: answered once admitted, polled (and streamed, then read again from an event) to the
  same answer a plain request gets; cancelled mid-generation, or its gateway killed, the
  engine left idle with every KV block free (killed: the response reads failed once its
  lease runs out).

tool_choice required and text.format json_schema ask the engine for a constraint: they
pass once the engine's constrained decoding (issue 29) is merged.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError, OpenAI
from redis.asyncio import Redis

from conveyor.gateway.tenancy.api_keys import ApiKeyStore
from conveyor.gateway.tenancy.tiers import DEFAULT_TIERS

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "name": "get_weather",
           "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False},
           "strict": True}


@pytest.fixture(scope="module")
def client(stack) -> OpenAI:
    return OpenAI(base_url=stack.api_url, api_key="unused-locally", max_retries=0)


def test_create_answers_with_a_message(client):
    response = client.responses.create(model=MODEL, input="Name a colour.",
                                       instructions="Answer in one word.",
                                       max_output_tokens=16, temperature=0,
                                       metadata={"suite": "e2e"})
    assert response.object == "response" and response.status in ("completed", "incomplete")
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text.strip()
    assert response.usage.input_tokens > 0 and 0 < response.usage.output_tokens <= 16
    assert response.usage.total_tokens == (response.usage.input_tokens
                                           + response.usage.output_tokens)
    assert response.metadata == {"suite": "e2e"} and response.instructions == "Answer in one word."


def test_a_stream_iterates_the_sdks_events(client):
    events = list(client.responses.create(model=MODEL, input="Say hello to a robot.",
                                          max_output_tokens=24, temperature=0, stream=True))
    types = [event.type for event in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    final = events[-1].response
    assert len(deltas) > 1 and "".join(deltas) == final.output_text == events[-4].text
    assert final.usage.output_tokens <= 24


def test_a_function_tool_is_called_then_answered(client):
    """Needs constrained decoding (tool_choice required) from the engine."""
    stream = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                     tools=[WEATHER], tool_choice="required",
                                     max_output_tokens=64, temperature=0, stream=True)
    events = list(stream)
    types = [event.type for event in events]
    assert "response.function_call_arguments.delta" in types
    assert "response.function_call_arguments.done" in types
    first = events[-1].response
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments
    answer = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=32,
        temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"weather": "sunny", "celsius": 21})}])
    assert answer.previous_response_id == first.id
    assert answer.output[0].type in ("message", "function_call")
    assert answer.usage.input_tokens > first.usage.input_tokens  # the call and its output


def test_text_format_json_schema_is_followed(client):
    """Needs constrained decoding (a JSON schema) from the engine."""
    schema = {"type": "object", "properties": {"colour": {"type": "string"},
                                               "hex": {"type": "string"}},
              "required": ["colour", "hex"], "additionalProperties": False}
    response = client.responses.create(
        model=MODEL, input="Give a colour and its hex code.", max_output_tokens=64,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "colour", "schema": schema,
                         "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def test_a_three_turn_chain_reuses_the_prefix_cache(client):
    opening = ("We are planning a small garden with tomatoes, basil, peppers and marigolds. "
               "The beds get six hours of sun and the soil is sandy. Keep answers short.")
    first = client.responses.create(model=MODEL, input=opening + " What should we plant first?",
                                    max_output_tokens=24, temperature=0)
    second = client.responses.create(model=MODEL, previous_response_id=first.id,
                                     input="How often should we water them?",
                                     max_output_tokens=24, temperature=0)
    third = client.responses.create(model=MODEL, previous_response_id=second.id,
                                    input="And when do we harvest the basil?",
                                    max_output_tokens=24, temperature=0)
    cached = [r.usage.input_tokens_details.cached_tokens for r in (first, second, third)]
    inputs = [r.usage.input_tokens for r in (first, second, third)]
    assert inputs[0] < inputs[1] < inputs[2]  # each turn reads the whole conversation
    assert cached[1] >= 16 and cached[2] > cached[1], (cached, inputs)
    assert third.previous_response_id == second.id
    assert client.responses.retrieve(third.id).output_text == third.output_text
    items = list(client.responses.input_items.list(third.id, order="asc"))
    turns = [("message", "user"), ("message", "assistant")] * 2 + [("message", "user")]
    assert [(i.type, i.role) for i in items] == turns
    assert items[1].content[0].text == first.output_text
    assert items[4].content[0].text == "And when do we harvest the basil?"


@pytest.fixture(scope="module")
def auth_client(stack, module_launch):
    """A gateway with API keys on; `auth_client(key)` is an SDK client for one key."""
    gateway = module_launch.gateway("gateway-responses-auth",
                                    CONVEYOR_GATEWAY_AUTH_ENABLED="true")

    def make(key: str) -> OpenAI:
        return OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key=key,
                      max_retries=0)

    return make


def _new_key(stack) -> str:
    async def create() -> str:
        redis = Redis.from_url(stack.redis_url, decode_responses=True)
        try:
            store = ApiKeyStore(redis, DEFAULT_TIERS, prefix=stack.redis_prefix)
            return (await store.create(f"t-{uuid.uuid4().hex[:10]}", "standard")).key
        finally:
            await redis.aclose()

    return asyncio.run(create())


async def test_a_response_continues_a_conversation_and_adds_its_turn(stack):
    client = AsyncOpenAI(base_url=stack.api_url, api_key="unused-locally", max_retries=0)
    earlier = [{"role": "user", "content": "My name is Ada."},
               {"role": "assistant", "content": "Nice to meet you, Ada."}]
    conversation = await client.conversations.create(items=earlier, metadata={"suite": "e2e"})
    raw = await client.responses.with_raw_response.create(
        model=MODEL, input="What is my name?", conversation=conversation.id,
        max_output_tokens=8, temperature=0)
    response = raw.parse()
    assert response.conversation.id == conversation.id and response.output_text.strip()
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as http:
        counted = await http.post("/tokenize", json={"model": MODEL, "messages": [
            *earlier, {"role": "user", "content": "What is my name?"}]})
        timeline = await http.get(f"/v1/requests/{raw.headers['x-request-id']}")
    assert timeline.json()["num_prompt_tokens"] == counted.json()["count"]
    items = [i async for i in client.conversations.items.list(conversation.id, order="asc")]
    assert [i.role for i in items] == ["user", "assistant", "user", "assistant"]
    assert items[3].content[0].text == response.output_text
    await client.conversations.delete(conversation.id)
    with pytest.raises(NotFoundError):
        await client.responses.create(model=MODEL, input="again", conversation=conversation.id)


async def test_truncation_auto_serves_the_last_turns_that_fit(stack, idle_engine):
    client = AsyncOpenAI(base_url=stack.api_url, api_key="unused-locally", max_retries=0)
    texts = [f"Turn {i}: " + "the quick brown fox jumps over the lazy dog " * 4 for i in range(5)]
    turns = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(texts)]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as http:
        async def count(messages):
            reply = await http.post("/tokenize", json={"model": MODEL, "messages": messages})
            return reply.json()["count"]
        last, from_second_user = await count(turns[4:]), await count(turns[2:])
        assert from_second_user > last
        model = (await http.get(f"/v1/models/{MODEL}")).json()
        room = model["max_model_len"] - last  # the last turn alone fits, with nothing to spare
        with pytest.raises(BadRequestError) as caught:
            await client.responses.create(model=MODEL, input=turns, max_output_tokens=room)
        assert caught.value.code == "context_length_exceeded"
        async with await client.responses.create(model=MODEL, input=turns, stream=True,
                                                 max_output_tokens=room,
                                                 truncation="auto") as stream:
            request_id = stream.response.headers["x-request-id"]
            async for event in stream:
                if event.type == "response.created":
                    assert event.response.truncation == "auto"
                if event.type == "response.output_text.delta":
                    break  # closed early: the engine aborts the rest
        timeline = (await http.get(f"/v1/requests/{request_id}")).json()
    assert timeline["num_prompt_tokens"] == last
    stats = await idle_engine(30.0)
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks


def test_another_tenant_gets_404_for_a_stored_response(stack, auth_client):
    owner, other = auth_client(_new_key(stack)), auth_client(_new_key(stack))
    response = owner.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    assert owner.responses.retrieve(response.id).id == response.id
    with pytest.raises(NotFoundError):
        other.responses.retrieve(response.id)
    with pytest.raises(NotFoundError):
        other.responses.create(model=MODEL, input="Hi again", max_output_tokens=4,
                               previous_response_id=response.id)
    with pytest.raises(NotFoundError):
        other.responses.delete(response.id)
    owner.responses.delete(response.id)
    with pytest.raises(NotFoundError):
        owner.responses.retrieve(response.id)


async def _settled(client: AsyncOpenAI, response_id: str, timeout_s: float = 120.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (response := await client.responses.retrieve(response_id)).status in (
            "queued", "in_progress"):
        assert loop.time() < deadline, f"still {response.status}"
        await asyncio.sleep(0.05)
    return response


async def test_a_background_response_is_polled_to_the_plain_answer(stack):
    client = AsyncOpenAI(base_url=stack.api_url, api_key="unused-locally", max_retries=0)
    request = {"model": MODEL, "input": "Name three colours.", "max_output_tokens": 12,
               "temperature": 0}
    queued = await client.responses.create(**request, background=True)
    assert queued.status == "in_progress" and queued.background
    done = await _settled(client, queued.id)
    plain = await client.responses.create(**request)
    assert done.status == plain.status and done.output_text == plain.output_text != ""
    assert done.usage.output_tokens == plain.usage.output_tokens
    events = [e async for e in await client.responses.create(**request, background=True,
                                                             stream=True)]
    assert events[-1].response.output_text == plain.output_text
    again = await client.responses.retrieve(events[-1].response.id, stream=True,
                                            starting_after=len(events) - 3)
    assert [e.sequence_number async for e in again] == [len(events) - 2, len(events) - 1]


async def test_cancelling_a_background_response_frees_the_engine(stack, engine_client,
                                                                 idle_engine):
    client = AsyncOpenAI(base_url=stack.api_url, api_key="unused-locally", max_retries=0)
    queued = await client.responses.create(model=MODEL, input="Count from one to one thousand.",
                                           max_output_tokens=400, background=True)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while (await engine_client.stats()).num_running == 0:
        assert loop.time() < deadline, "the background response never started"
        await asyncio.sleep(0.02)
    assert (await client.responses.cancel(queued.id)).status == "cancelled"
    stats = await idle_engine(30.0)
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks
    assert (await client.responses.retrieve(queued.id)).status == "cancelled"


async def test_a_gateway_killed_mid_run_leaves_its_background_response_failed(
        stack, extra_gateway, engine_client, idle_engine):
    owner = extra_gateway(CONVEYOR_GATEWAY_RESPONSES_LEASE_S="2")
    created = await AsyncOpenAI(base_url=f"http://127.0.0.1:{owner.port}/v1", api_key="unused",
                                max_retries=0).responses.create(
        model=MODEL, input="Count from one to one thousand.", max_output_tokens=400,
        background=True)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while (await engine_client.stats()).num_running == 0:
        assert loop.time() < deadline, "the background response never started"
        await asyncio.sleep(0.02)
    owner.kill()  # SIGKILL: no drain, no goodbye; its lease runs out
    reader = AsyncOpenAI(base_url=stack.api_url, api_key="unused-locally", max_retries=0)
    failed = await _settled(reader, created.id, timeout_s=60)
    assert failed.status == "failed" and "stopped" in failed.error.message
    stats = await idle_engine(30.0)
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks


async def test_a_background_request_over_the_context_is_refused_at_once(stack):
    client = AsyncOpenAI(base_url=stack.api_url, api_key="unused-locally", max_retries=0)
    with pytest.raises(BadRequestError) as caught:
        await client.responses.create(model=MODEL, input="word " * 20000, background=True)
    assert caught.value.status_code == 400
