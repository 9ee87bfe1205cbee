"""The Conversations API over fake services and the real Redis, with the official SDK:
conversations and their items created, read in pages, changed and deleted per tenant;
Responses requests reading a conversation and adding their turn to it (plain, store false,
background; nothing when a background response is cancelled); refusals by name."""

from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError
from openai.types.conversations import ConversationItemList

from conveyor.common.redis_scripts import run_script_calls
from conveyor.gateway.responses.conversation_store import ConversationStore
from conveyor.gateway.responses.store import ResponseStore, StoredResponse


def _client(gateway, key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)


def _prompt(gateway) -> str:
    return "".join(chr(t) for t in gateway.fakes.engine.requests[-1].prompt_token_ids)


async def test_a_conversation_and_its_items_are_created_read_changed_and_deleted(gateway):
    conversations = _client(gateway).conversations
    created = await conversations.create(metadata={"topic": "demo"}, items=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "bye"}]}])
    assert created.id.startswith("conv_") and created.metadata == {"topic": "demo"}
    assert (await conversations.retrieve(created.id)).created_at == created.created_at
    changed = await conversations.update(created.id, metadata={"topic": "other"})
    assert changed.metadata == {"topic": "other"}
    items = [i async for i in conversations.items.list(created.id, order="asc", limit=2)]
    assert [(i.role, i.content[0].type, i.content[0].text) for i in items] == [
        ("user", "input_text", "hi"), ("assistant", "output_text", "hello"),
        ("user", "input_text", "bye")]
    assert all(i.status == "completed" and i.id.startswith("msg_") for i in items)
    newest = await conversations.items.list(created.id, limit=1)
    assert [i.id for i in newest.data] == [items[2].id] and newest.has_more
    added = await conversations.items.create(created.id, items=[
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42", "id": "fco_mine"}])
    assert [i.type for i in added.data] == ["function_call", "function_call_output"]
    assert added.last_id == "fco_mine"
    mine = await conversations.items.retrieve("fco_mine", conversation_id=created.id)
    assert mine.output == "42"
    after_delete = await conversations.items.delete(items[1].id, conversation_id=created.id)
    assert after_delete.id == created.id
    left = [i.id async for i in conversations.items.list(created.id, order="asc")]
    assert left == [items[0].id, items[2].id, added.data[0].id, "fco_mine"]
    with pytest.raises(NotFoundError):
        await conversations.items.retrieve(items[1].id, conversation_id=created.id)
    deleted = await conversations.delete(created.id)
    assert deleted.deleted and deleted.object == "conversation.deleted"
    for gone in (conversations.retrieve(created.id), conversations.delete(created.id),
                 conversations.items.create(created.id, items=[{"role": "user", "content": "x"}])):
        with pytest.raises(NotFoundError):
            await gone


async def test_a_conversation_is_kept_its_own_time_after_its_last_change(
        gateway_factory, redis, prefix):
    gateway = await gateway_factory(conversations_ttl_s=50, responses_ttl_s=5)
    conversation = await _client(gateway).conversations.create(
        items=[{"role": "user", "content": "x"}])
    keys = [key async for key in redis.scan_iter(f"{prefix}:conversation*")]
    assert len(keys) == 2  # the conversation and its items
    assert all(5_000 < ttl <= 50_000 for ttl in [await redis.pttl(key) for key in keys])
    assert conversation.id


async def test_a_response_reads_the_conversation_and_adds_its_turn(gateway):
    client = _client(gateway)
    conversation = await client.conversations.create(items=[{"role": "user", "content": "hi"}])
    first = await client.responses.create(model="fake-model", input="more",
                                          conversation=conversation.id, max_output_tokens=3)
    assert _prompt(gateway) == "user:hi\nuser:more\nassistant:"
    assert first.conversation.id == conversation.id
    items = [i async for i in client.conversations.items.list(conversation.id, order="asc")]
    assert [(i.role, i.content[0].text) for i in items] == [
        ("user", "hi"), ("user", "more"), ("assistant", "Hel")]
    assert items[2].id == first.output[0].id
    await client.responses.create(model="fake-model", input="again", store=False,
                                  conversation={"id": conversation.id}, max_output_tokens=2)
    assert _prompt(gateway) == "user:hi\nuser:more\nassistant:Hel\nuser:again\nassistant:"
    count = len([i async for i in client.conversations.items.list(conversation.id)])
    assert count == 5  # store false keeps no response, but the conversation has the turn


async def test_a_background_response_adds_its_turn_once_saved_and_none_when_cancelled(
        gateway, wait_until):
    client = _client(gateway)
    conversation = await client.conversations.create()
    done = await client.responses.create(model="fake-model", input="a", background=True,
                                         conversation=conversation.id, max_output_tokens=2)
    await wait_until(lambda: not gateway.app.state.background.running, timeout_s=5)
    assert (await client.responses.retrieve(done.id)).status == "incomplete"
    texts = [i.content[0].text async for i in client.conversations.items.list(conversation.id)]
    assert texts == ["He", "a"]
    gateway.fakes.engine.delay_s = 0.05
    running = await client.responses.create(model="fake-model", input="b", background=True,
                                            conversation=conversation.id, max_output_tokens=80)
    await wait_until(lambda: gateway.fakes.engine.running, timeout_s=5)
    assert (await client.responses.cancel(running.id)).status == "cancelled"
    await wait_until(lambda: not gateway.app.state.background.running, timeout_s=5)
    assert len([i async for i in client.conversations.items.list(conversation.id)]) == 2


@pytest.mark.parametrize("ending", ["saved", "cancelled", "deleted", "lease lost"])
async def test_a_background_turn_is_added_only_with_its_saved_response(redis, prefix, ending):
    """The save and the add run in one round trip, save first (the settlement's order); the
    add goes through only where the save did."""
    responses = ResponseStore(redis, prefix=prefix)
    conversations = ConversationStore(redis, prefix=prefix)
    conversation = await conversations.create("t", {}, [])
    response = {"id": "resp-1", "background": True, "status": "queued"}
    await responses.create_background("t", StoredResponse(response, []), lease_s=30)
    await responses.advance("t", "resp-1", "in_progress", 0.05 if ending == "lease lost" else 30)
    if ending == "cancelled":
        await responses.advance("t", "resp-1", "cancelled")
    elif ending == "deleted":
        await responses.delete("t", "resp-1")
    elif ending == "lease lost":
        await asyncio.sleep(0.1)  # past the lease, on Redis's clock
    item = {"id": "msg_1", "type": "message", "role": "user", "content": []}
    saved, added = await run_script_calls(redis, [
        responses.save_call("t", StoredResponse({**response, "status": "completed"}, [])),
        conversations.add_call("t", conversation["id"], [item],
                               responses.saved_keys("t", "resp-1"))])
    assert (saved, added) == ((1, 1) if ending == "saved" else (0, 0))
    expected = [item] if ending == "saved" else []
    assert await conversations.items("t", conversation["id"]) == expected


async def test_truncation_auto_cuts_what_the_model_reads_not_the_conversation(gateway):
    client = _client(gateway)
    turns = [{"role": ("user", "assistant")[i % 2], "content": c * 30} for i, c in
             enumerate("abc")]
    conversation = await client.conversations.create(items=turns)
    await client.responses.create(model="fake-model", input="d" * 30, truncation="auto",
                                  conversation=conversation.id, max_output_tokens=2)
    assert _prompt(gateway) == f"user:{'c' * 30}\nuser:{'d' * 30}\nassistant:"
    assert len([i async for i in client.conversations.items.list(conversation.id)]) == 5


async def test_an_item_id_is_taken_once_per_conversation(gateway):
    client = _client(gateway)
    mine = {"id": "msg_mine", "role": "user", "content": "x"}
    with pytest.raises(BadRequestError) as caught:
        await client.conversations.create(items=[mine, mine])
    assert caught.value.body["param"] == "items"
    conversation = await client.conversations.create(items=[mine])
    for call, param in ((client.conversations.items.create(conversation.id, items=[mine]),
                         "items"),
                        (client.responses.create(model="fake-model", input=[mine],
                                                 conversation=conversation.id), "input")):
        with pytest.raises(BadRequestError) as caught:
            await call
        assert caught.value.body["param"] == param and "msg_mine" in caught.value.message
    assert len([i async for i in client.conversations.items.list(conversation.id)]) == 1
    assert not gateway.fakes.engine.requests


async def test_items_are_kept_in_the_sdks_shapes(gateway):
    client = _client(gateway)
    conversation = await client.conversations.create(items=[
        {"role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "b",
                                      "prompt_cache_breakpoint": {"x": 1}}]},
        {"type": "function_call_output", "call_id": "c", "output": [
            {"type": "output_text", "text": "4"}, {"type": "output_text", "text": "2"}]}])
    await client.responses.create(model="fake-model", input="c", max_output_tokens=2,
                                  conversation=conversation.id, top_logprobs=1,
                                  include=["message.output_text.logprobs"])
    async with gateway.client() as http:
        raw = (await http.get(f"/v1/conversations/{conversation.id}/items",
                              params={"order": "asc"})).json()
    ConversationItemList.model_validate(raw, strict=True)
    assert raw["data"][0]["content"][0]["annotations"] == []
    assert raw["data"][2]["output"] == "42"
    assert "logprobs" not in raw["data"][4]["content"][0]


@pytest.mark.parametrize(("call", "param"), [
    (lambda c: c.conversations.create(items=[{"type": "item_reference", "id": "msg_1"}]),
     "items"),
    (lambda c: c.conversations.create(items=[{"role": "user", "content": "x"}] * 21), "items"),
    (lambda c: c.conversations.create(metadata={str(i): "v" for i in range(17)}), "metadata"),
    (lambda c: c.conversations.items.list("conv_x", include=["message.output_text.logprobs"]),
     "include"),
    (lambda c: c.conversations.items.create("conv_x", items=[]), "items"),
])
async def test_what_cannot_be_served_is_refused_by_name(gateway, call, param):
    with pytest.raises(BadRequestError) as caught:
        await call(_client(gateway))
    assert caught.value.body["param"].startswith(param)


async def test_an_unknown_conversation_is_404_and_another_tenants_is_unknown(
        two_tenants):
    gateway, owner_key, other_key = two_tenants
    owner, other = _client(gateway, owner_key), _client(gateway, other_key)
    conversation = await owner.conversations.create(items=[{"role": "user", "content": "x"}])
    for call in (other.conversations.retrieve(conversation.id),
                 other.conversations.items.list(conversation.id),
                 other.conversations.update(conversation.id, metadata={})):
        with pytest.raises(NotFoundError):
            await call
    with pytest.raises(NotFoundError) as caught:
        await other.responses.create(model="fake-model", input="y",
                                     conversation=conversation.id)
    assert caught.value.body["param"] == "conversation"
    assert not gateway.fakes.engine.requests
