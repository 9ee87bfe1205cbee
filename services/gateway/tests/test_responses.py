"""The Responses API over fake services and the real Redis: the official SDK's own
parsing of responses and events, stored responses per tenant, input items, refusals."""

from __future__ import annotations

import json

import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from conveyor.gateway.clients.detok import GenerationDelta, ToolCallDelta
from conveyor.gateway.clients.engine import TokenUsage
from conveyor.gateway.clients.tokenizer import PromptTokens
from conveyor.gateway.response_formats import OutputOptions
from conveyor.gateway.responses.conversation import chat_request
from conveyor.gateway.responses.output_format import ResponsesFormat
from conveyor.gateway.responses.request_body import ResponsesRequest
from conveyor.gateway.tenancy.api_keys import ApiKeyStore
from conveyor.gateway.tenancy.tiers import DEFAULT_TIERS
from conveyor.gateway.usage_totals import UsageTotals

EVENTS = TypeAdapter(ResponseStreamEvent)


def _client(gateway, key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)


def _prompt_text(request) -> str:
    return "".join(chr(t) for t in request.prompt_token_ids)


async def test_create_returns_a_response_the_sdk_reads(gateway):
    response = await _client(gateway).responses.create(
        model="fake-model", input="hi", instructions="Be brief.", max_output_tokens=5,
        metadata={"k": "v"}, temperature=0.5)
    assert response.status == "incomplete" and response.incomplete_details.reason == \
        "max_output_tokens"
    assert response.output_text == "Hello"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        len("system:Be brief.\nuser:hi\nassistant:"), 5)
    assert response.usage.input_tokens_details.cached_tokens == 3
    assert response.metadata == {"k": "v"} and response.instructions == "Be brief."
    [request] = gateway.fakes.engine.requests
    assert _prompt_text(request) == "system:Be brief.\nuser:hi\nassistant:"
    assert request.sampling.max_tokens == 5 and abs(request.sampling.temperature - 0.5) < 1e-6


async def test_a_streamed_response_is_the_sdks_event_sequence(gateway):
    stream = await _client(gateway).responses.create(model="fake-model", input="hi",
                                                     max_output_tokens=4, stream=True)
    events = [event async for event in stream]
    types = [event.type for event in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added",
                     *["response.output_text.delta"] * (types.count("response.output_text.delta")),
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "Hell" == events[-1].response.output_text
    assert events[-4].text == deltas


async def test_stored_responses_chain_and_can_be_read_and_deleted(gateway):
    client = _client(gateway)
    first = await client.responses.create(model="fake-model", input="one", max_output_tokens=3)
    second = await client.responses.create(model="fake-model", input="two", max_output_tokens=3,
                                           previous_response_id=first.id)
    later = gateway.fakes.engine.requests[-1]
    assert _prompt_text(later) == "user:one\nassistant:Hel\nuser:two\nassistant:"
    assert (await client.responses.retrieve(second.id)).output_text == "Hel"
    await client.responses.delete(first.id)
    with pytest.raises(NotFoundError):
        await client.responses.retrieve(first.id)
    with pytest.raises(NotFoundError) as caught:
        await client.responses.create(model="fake-model", input="x", previous_response_id=first.id)
    assert caught.value.body["param"] == "previous_response_id"


def _turns(*texts: str) -> list[dict]:
    """Messages alternating user, assistant, user, ..."""
    return [{"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(texts)]


async def test_truncation_auto_drops_the_oldest_turns_until_the_conversation_fits(gateway):
    client = _client(gateway)
    a, b, c, d, e = "a" * 60, "b" * 5, "c" * 20, "d" * 20, "e" * 20  # fake tokens: characters
    conversation = {"model": "fake-model", "instructions": "be brief", "max_output_tokens": 2,
                    "input": _turns(a, b, c, d, e)}  # 191 tokens with the instructions: > 128
    # from b on it would fit (125 + 2), but a cut falls only where a turn starts (a user message)
    with pytest.raises(BadRequestError) as caught:
        await client.responses.create(**conversation)
    assert caught.value.code == "context_length_exceeded" and not gateway.fakes.engine.requests
    response = await client.responses.create(**conversation, truncation="auto")
    [request] = gateway.fakes.engine.requests
    assert _prompt_text(request) == (
        f"system:be brief\nuser:{c}\nassistant:{d}\nuser:{e}\nassistant:")
    assert response.truncation == "auto" and response.usage.input_tokens == 109
    items = [i async for i in client.responses.input_items.list(response.id, order="asc")]
    assert [i.content[0].text for i in items] == [a, b, c, d, e]  # stored whole
    later = await client.responses.create(model="fake-model", input=a, max_output_tokens=2,
                                          previous_response_id=response.id, truncation="auto")
    assert _prompt_text(gateway.fakes.engine.requests[-1]) == (
        f"user:{e}\nassistant:He\nuser:{a}\nassistant:")  # the stored turns cut the same way
    assert later.truncation == "auto"


async def test_truncation_auto_keeps_the_whole_conversation_when_it_fits(gateway):
    client = _client(gateway)
    await client.responses.create(model="fake-model", input=_turns("one", "two", "three"),
                                  max_output_tokens=2, truncation="auto")
    [request] = gateway.fakes.engine.requests
    assert _prompt_text(request) == "user:one\nassistant:two\nuser:three\nassistant:"


async def test_truncation_auto_leaves_room_for_an_answer_when_no_maximum_is_asked(gateway):
    c = "c" * 85  # from this turn on the prompt is exactly 128 tokens: no room to answer
    await _client(gateway).responses.create(
        model="fake-model", input=_turns("a" * 10, "b" * 5, c, "d" * 5, "e" * 5),
        truncation="auto")
    assert _prompt_text(gateway.fakes.engine.requests[0]) == "user:eeeee\nassistant:"


async def test_truncation_auto_cuts_an_agents_calls_after_its_last_user_message(gateway):
    def call(name: str, output: str) -> list[dict]:
        return [{"type": "function_call", "call_id": name, "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": name, "output": output}]

    await _client(gateway).responses.create(
        model="fake-model", input=[{"role": "user", "content": "q" * 50},
                                   *call("c1", "x" * 40), *call("c2", "y" * 40)],
        truncation="auto", max_output_tokens=2)  # 180 tokens whole, 124 from the first call
    assert _prompt_text(gateway.fakes.engine.requests[0]) == (
        f"assistant:\ntool:{'x' * 40}\nassistant:\ntool:{'y' * 40}\nassistant:")


async def test_truncation_auto_refuses_a_last_turn_that_does_not_fit_alone(gateway):
    with pytest.raises(BadRequestError) as caught:
        await _client(gateway).responses.create(
            model="fake-model", input=_turns("x", "y", "z" * 200), truncation="auto")
    assert caught.value.code == "context_length_exceeded" and not gateway.fakes.engine.requests


async def test_input_items_list_the_chain_before_the_answer_in_pages(gateway):
    client = _client(gateway)
    tools = [{"type": "function", "name": "weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    first = await client.responses.create(
        model="fake-model", instructions="be brief", tools=tools, max_output_tokens=3,
        input=[{"role": "user", "content": "weather?"},
               {"type": "function_call", "call_id": "call_1", "name": "weather",
                "arguments": '{"city": "Oslo"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    second = await client.responses.create(model="fake-model", input="thanks",
                                           max_output_tokens=3, previous_response_id=first.id)
    items = [item async for item in client.responses.input_items.list(second.id, order="asc",
                                                                      limit=2)]
    assert [(i.type, getattr(i, "role", None)) for i in items] == [
        ("message", "user"), ("function_call", None), ("function_call_output", None),
        ("message", "assistant"), ("message", "user")]  # no instructions, no second answer
    assert items[1].call_id == "call_1" and items[1].arguments == '{"city": "Oslo"}'
    assert items[2].output == "sunny" and items[3].content[0].text == "Hel"
    assert items[4].content[0].text == "thanks" and len({i.id for i in items}) == 5
    newest = await client.responses.input_items.list(second.id, limit=2)
    assert [i.id for i in newest.data] == [items[4].id, items[3].id] and newest.has_more
    rest = await client.responses.input_items.list(second.id, after=items[3].id)
    assert [i.id for i in rest.data] == [i.id for i in items[2::-1]] and not rest.has_more
    for query, param in (({"include": ["message.output_text.logprobs"]}, "include"),
                         ({"after": "msg_unknown"}, "after")):
        with pytest.raises(BadRequestError) as caught:
            await client.responses.input_items.list(second.id, **query)
        assert caught.value.body["param"] == param
    with pytest.raises(NotFoundError):
        await client.responses.input_items.list("resp-unknown")


async def test_store_false_keeps_nothing(gateway):
    client = _client(gateway)
    response = await client.responses.create(model="fake-model", input="x", store=False,
                                             max_output_tokens=2)
    with pytest.raises(NotFoundError):
        await client.responses.retrieve(response.id)


async def test_another_tenant_cannot_read_a_stored_response(gateway_factory, redis, prefix):
    gateway = await gateway_factory(auth_enabled=True)
    keys = ApiKeyStore(redis, DEFAULT_TIERS, prefix=prefix)
    owner = (await keys.create("owner", "standard")).key
    other = (await keys.create("other", "standard")).key
    response = await _client(gateway, owner).responses.create(model="fake-model", input="x",
                                                              max_output_tokens=2)
    assert (await _client(gateway, owner).responses.retrieve(response.id)).id == response.id
    with pytest.raises(NotFoundError):
        await _client(gateway, other).responses.retrieve(response.id)
    with pytest.raises(NotFoundError):
        await _client(gateway, other).responses.create(
            model="fake-model", input="y", previous_response_id=response.id)


async def test_function_calls_and_outputs_become_chat_turns(gateway):
    tools = [{"type": "function", "name": "weather", "description": "Weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    items = [{"role": "user", "content": "weather?"},
             {"type": "function_call", "call_id": "call_1", "name": "weather",
              "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    response = await _client(gateway).responses.create(
        model="fake-model", input=items, tools=tools, tool_choice="auto", max_output_tokens=2)
    assert response.tools[0].name == "weather" and response.tool_choice == "auto"
    [request] = gateway.fakes.engine.requests
    assert _prompt_text(request) == "user:weather?\nassistant:\ntool:sunny\nassistant:"


@pytest.mark.parametrize(("body", "param"), [
    ({"background": True, "store": False}, "background"),
    ({"background_options": {}}, "background_options"),  # without background
    ({"background": True, "background_options": {"completion_window": "2h"}},
     "background_options.completion_window"),
    ({"background": True, "background_options": {"continuation_id": "c"}},
     "background_options.continuation_id"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"conversation": "conv_1", "previous_response_id": "resp-1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"reasonin": {}}, "reasonin"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
async def test_what_cannot_be_served_is_refused_by_name(gateway, body, param):
    async with gateway.client() as client:
        response = await client.post("/v1/responses", json={"input": "x", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)
    assert not gateway.fakes.engine.requests


async def test_text_format_json_schema_asks_the_engine_for_it(gateway):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    await _client(gateway).responses.create(
        model="fake-model", input="x", max_output_tokens=2,
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema}})
    [request] = gateway.fakes.engine.requests
    assert json.loads(request.structured_output.json_schema) == schema


async def test_logprobs_on_request(gateway):
    response = await _client(gateway).responses.create(
        model="fake-model", input="x", max_output_tokens=2, top_logprobs=1,
        include=["message.output_text.logprobs"])
    [logprob_a, _] = response.output[0].content[0].logprobs
    assert logprob_a.token == "H" and len(logprob_a.top_logprobs) == 1


def _format(**request) -> ResponsesFormat:
    body = ResponsesRequest.model_validate({"input": "x", **request})
    return ResponsesFormat("resp-1", "m", None, OutputOptions(), [PromptTokens([1, 2], "", 9)],
                           chat_request(body).turn)


def test_tool_call_deltas_stream_as_function_call_items():
    fmt = _format()
    usage = UsageTotals([2], 1)
    deltas = [GenerationDelta("Sure.", [1], []),
              GenerationDelta("", [2], [], tool_calls=[ToolCallDelta(0, "call_a", "weather")]),
              GenerationDelta("", [3], [], tool_calls=[ToolCallDelta(0, arguments='{"c":')]),
              GenerationDelta("", [4], [], "stop", usage=TokenUsage(2, 4),
                              tool_calls=[ToolCallDelta(0, arguments='"x"}')])]
    events = fmt.opening_chunks(1)
    for delta in deltas:
        usage.observe(0, delta)
        events += fmt.delta_chunks(0, delta, {})
    events += fmt.closing_chunks(usage)
    parsed = [EVENTS.validate_python(json.loads(fmt.encode(e).split(b"data: ")[1]))
              for e in events]
    assert [e.type for e in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = parsed[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]
    call = final.output[1]
    assert (call.call_id, call.name, call.arguments) == ("call_a", "weather", '{"c":"x"}')
    stored = fmt.turn.stored
    assert stored.conversation[-1] == {
        "role": "assistant", "content": "Sure.",
        "tool_calls": [{"id": "call_a", "type": "function",
                        "function": {"name": "weather", "arguments": '{"c":"x"}'}}]}
    assert Response.model_validate(stored.response).id == "resp-1"


async def test_bodies_and_events_validate_against_the_sdks_models(gateway):
    """The SDK reads leniently; its pydantic models, validated strictly, say whether
    every field it declares required is there, with its type."""
    body = {"model": "fake-model", "input": "hi", "max_output_tokens": 3}
    async with gateway.client() as client:
        whole = await client.post("/v1/responses", json=body)
        streamed = await client.post("/v1/responses", json={**body, "stream": True})
    Response.model_validate(whole.json())
    lines = streamed.text.split("\n\n")
    events = [block.split("\n") for block in lines if block]
    for name_line, data_line in events:
        event = EVENTS.validate_python(json.loads(data_line.removeprefix("data: ")))
        assert name_line == f"event: {event.type}"
    assert not streamed.text.rstrip().endswith("[DONE]")


async def test_a_stream_that_fails_ends_with_error_and_response_failed(gateway):
    gateway.fakes.engine.fail_after, gateway.fakes.engine.delay_s = 3, 0.05
    body = {"model": "fake-model", "input": "hi", "max_output_tokens": 5, "stream": True}
    async with gateway.client() as client:
        streamed = await client.post("/v1/responses", json=body)
    events = [EVENTS.validate_python(json.loads(block.split("data: ", 1)[1]))
              for block in streamed.text.split("\n\n") if block]
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1].response.status == "failed" and events[-1].response.error.message
