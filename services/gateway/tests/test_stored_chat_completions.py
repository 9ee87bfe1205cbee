"""Stored chat completions (`store: true`) over fake services and the real Redis, with the
official SDK: kept whole (streamed ones assembled, n > 1), listed in pages with model and
metadata filters, their messages listed, metadata changed, deleted; per tenant; nothing kept
without store or for a request that failed; refusals by name."""

from __future__ import annotations

import pytest
from openai import APIError, AsyncOpenAI, BadRequestError, NotFoundError

from conveyor.common.redis_scripts import run_script_calls
from conveyor.gateway.stored_chat import store as stored_chat

MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi "},
                                         {"type": "text", "text": "there"}]}]


def _client(gateway, key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)


async def _create(client: AsyncOpenAI, **fields):
    return await client.chat.completions.create(
        model="fake-model", messages=fields.pop("messages", MESSAGES), max_tokens=3, **fields)


async def test_a_stored_completion_is_read_back_whole_with_its_messages(gateway):
    client = _client(gateway)
    created = await _create(client, store=True, metadata={"app": "demo"}, n=2)
    stored = await client.chat.completions.retrieve(created.id)
    assert stored.model_dump(exclude={"metadata"}) == created.model_dump(exclude={"metadata"})
    assert stored.metadata == {"app": "demo"}
    messages = [m async for m in client.chat.completions.messages.list(created.id)]
    assert [(m.id, m.role, m.content) for m in messages] == [
        (f"{created.id}-0", "system", "be brief"), (f"{created.id}-1", "user", "hi there")]
    assert messages[0].content_parts is None
    assert [p.text for p in messages[1].content_parts] == ["hi ", "there"]
    newest = await client.chat.completions.messages.list(created.id, order="desc", limit=1)
    assert [m.id for m in newest.data] == [messages[1].id] and newest.has_more


async def test_a_streamed_completion_is_stored_as_its_assembled_whole(gateway):
    client = _client(gateway)
    chunks = [c async for c in await _create(client, store=True, stream=True, logprobs=True,
                                            n=2)]
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks
                     if c.choices and c.choices[0].index == i) for i in (0, 1)]
    stored = await client.chat.completions.retrieve(chunks[0].id)
    assert stored.object == "chat.completion"
    assert [c.message.content for c in stored.choices] == texts
    assert stored.choices[1].finish_reason == "length" and stored.usage.completion_tokens == 6
    assert len(stored.choices[0].logprobs.content) == 3


async def test_a_stored_completion_expires_and_keeps_its_time_to_live_when_changed(
        gateway, redis, prefix):
    created = await _create(_client(gateway), store=True)
    keys = [key async for key in redis.scan_iter(f"{prefix}:chat-completion*")]
    assert len(keys) == 3  # the completion, its messages, the tenant's index
    assert all(0 < ttl <= 86_400_000 for ttl in [await redis.pttl(key) for key in keys])
    await _client(gateway).chat.completions.update(created.id, metadata={"a": "b"})
    assert all(0 < ttl <= 86_400_000 for ttl in [await redis.pttl(key) for key in keys])


async def test_nothing_is_stored_without_store_or_for_a_request_that_failed(gateway):
    client = _client(gateway)
    plain = await _create(client)
    with pytest.raises(BadRequestError):
        await _create(client, store=True, messages=[{"role": "user", "content": "x" * 200}])
    gateway.fakes.engine.fail_after = 1  # mid-stream
    with pytest.raises(APIError):
        [c async for c in await _create(client, store=True, stream=True)]
    with pytest.raises(NotFoundError):
        await client.chat.completions.retrieve(plain.id)
    assert [c async for c in client.chat.completions.list()] == []


async def test_the_list_pages_and_filters_by_model_and_metadata(gateway):
    client = _client(gateway)
    ids = [(await _create(client, store=True, metadata={"run": str(i % 2), "i": str(i)})).id
           for i in range(5)]
    assert [c.id async for c in client.chat.completions.list(limit=2)] == ids
    assert [c.id async for c in client.chat.completions.list(model="fake-model")] == ids
    assert (await client.chat.completions.list(model="another")).data == []
    newest = await client.chat.completions.list(order="desc", limit=2)
    assert [c.id for c in newest.data] == ids[:2:-1] and newest.has_more
    older = await client.chat.completions.list(order="desc", after=ids[3], limit=2)
    assert [c.id for c in older.data] == [ids[2], ids[1]]
    odd = await client.chat.completions.list(metadata={"run": "1"})
    assert [c.id for c in odd.data] == [ids[1], ids[3]] and not odd.has_more
    both = await client.chat.completions.list(metadata={"run": "1", "i": "3"})
    assert [c.id for c in both.data] == [ids[3]]
    after = await client.chat.completions.list(after=ids[1], limit=2, metadata={"run": "0"})
    assert [c.id for c in after.data] == [ids[2], ids[4]]
    first = await client.chat.completions.list(limit=2)
    await client.chat.completions.delete(ids[1])  # the page's cursor
    rest = await first.get_next_page()
    assert [c.id for c in rest.data] == ids[2:4]
    assert [c.id async for c in client.chat.completions.list()] == [ids[0], *ids[2:]]


async def test_a_list_skips_what_expired_and_a_save_trims_it_from_the_index(
        redis, prefix, monkeypatch):
    monkeypatch.setattr(stored_chat, "_PAGE", 2)  # the index read two ids at a time
    store = stored_chat.ChatCompletionStore(redis, prefix=prefix)
    ids = [f"chatcmpl-{i}" for i in range(5)]
    await run_script_calls(redis, [store.save_call("t", {"id": i, "model": "m"}, [])
                                   for i in ids])
    index = f"{prefix}:chat-completions:{{t}}"
    await redis.delete(f"{prefix}:chat-completion:{{t}}:{ids[1]}")  # as its expiry would
    page, more = await store.page("t", None, 10, False, lambda completion: True)
    assert [c["id"] for c in page] == [ids[0], *ids[2:]] and not more
    short = stored_chat.ChatCompletionStore(redis, prefix=prefix, ttl_s=0.05)
    scores = dict(await redis.zrange(index, 0, -1, withscores=True))
    await redis.zadd(index, {ids[0]: scores[ids[0]] - 1e6})  # stored a second earlier
    await run_script_calls(redis, [short.save_call("t", {"id": "chatcmpl-new"}, [])])
    assert await redis.zscore(index, ids[0]) is None and await redis.zcard(index) == 5


async def test_metadata_is_changed_and_a_deleted_completion_is_gone(gateway):
    client = _client(gateway)
    created = await _create(client, store=True)
    changed = await client.chat.completions.update(created.id, metadata={"reviewed": "yes"})
    assert changed.metadata == {"reviewed": "yes"} and changed.id == created.id
    assert (await client.chat.completions.retrieve(created.id)).metadata == {"reviewed": "yes"}
    deleted = await client.chat.completions.delete(created.id)
    assert deleted.deleted and deleted.object == "chat.completion.deleted"
    for call in (client.chat.completions.retrieve(created.id),
                 client.chat.completions.delete(created.id),
                 client.chat.completions.messages.list(created.id),
                 client.chat.completions.update(created.id, metadata={})):
        with pytest.raises(NotFoundError):
            await call


@pytest.mark.parametrize(("query", "param"), [
    ({"after": "chatcmpl-unknown"}, "after"), ({"limit": 0}, "limit"),
    ({"include": "x"}, "include"), ({"metadata": "x"}, "metadata"),
    ({"metadata[k=1": "x"}, "metadata[k=1"), ({"metadata[]": "x"}, "metadata[]"),
    ([("model", "a"), ("model", "b")], "model")])
async def test_what_the_list_cannot_serve_is_refused_by_name(gateway, query, param):
    async with gateway.client() as http:
        response = await http.get("/v1/chat/completions", params=query)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].endswith(param)


async def test_another_tenant_neither_reads_nor_lists_a_stored_completion(
        two_tenants):
    gateway, owner_key, other_key = two_tenants
    owner, other = _client(gateway, owner_key), _client(gateway, other_key)
    created = await _create(owner, store=True)
    for call in (other.chat.completions.retrieve(created.id),
                 other.chat.completions.messages.list(created.id),
                 other.chat.completions.update(created.id, metadata={}),
                 other.chat.completions.delete(created.id)):
        with pytest.raises(NotFoundError):
            await call
    assert (await other.chat.completions.list()).data == []
    assert [c.id async for c in owner.chat.completions.list()] == [created.id]
