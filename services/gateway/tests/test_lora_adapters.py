"""LoRA adapters at the gateway (fake gRPC services, real Redis): the catalog seeded from
the setting and changed by the admin endpoints, adapters as models in /v1/models and in
requests (the engine gets the adapter, the response names it), owners' adapters hidden
from other tenants, and who may load and unload."""

from __future__ import annotations

import openai
import pytest

from conveyor.gateway.tenancy.api_keys import ApiKeyStore
from conveyor.gateway.tenancy.tiers import DEFAULT_TIERS

STATIC = "sql=/adapters/sql, chat=/adapters/chat"


def chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def load(name: str, path: str, **extra) -> dict:
    return {"lora_name": name, "lora_path": path, **extra}


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def model_ids(response) -> list[str]:
    assert response.status_code == 200, response.text
    return [card["id"] for card in response.json()["data"]]


@pytest.fixture
def key_of(redis, prefix):
    """`await key_of(tenant, admin=False)`: auth headers of a new key."""
    store = ApiKeyStore(redis, DEFAULT_TIERS, prefix=prefix)

    async def create(tenant: str, admin: bool = False) -> dict[str, str]:
        created = await store.create(tenant, "standard", admin=admin)
        return {"Authorization": f"Bearer {created.key}"}

    return create


@pytest.fixture
async def updatable(gateway_factory):
    """A gateway with keys off that allows runtime updates."""
    return await gateway_factory(allow_runtime_lora_updating=True)


async def test_static_adapters_are_models_with_their_parent_and_folder(gateway_factory):
    gateway = await gateway_factory(lora_modules=STATIC)
    async with gateway.client() as client:
        listed = (await client.get("/v1/models")).json()["data"]
        sql = (await client.get("/v1/models/sql")).json()
    assert [(m["id"], m["parent"], m["root"]) for m in listed] == [
        ("fake-model", None, "fake-model"), ("chat", "fake-model", "/adapters/chat"),
        ("sql", "fake-model", "/adapters/sql")]
    assert sql == {**listed[2], "created": sql["created"]}


async def test_a_request_naming_an_adapter_sends_it_to_the_engine_and_answers_its_name(
        gateway_factory):
    gateway = await gateway_factory(lora_modules=STATIC)
    async with gateway.client() as client:
        chatted = await client.post("/v1/chat/completions", json=chat("sql"))
        completed = await client.post("/v1/completions", json={
            "model": "chat", "prompt": "a", "max_tokens": 2})
        responded = await client.post("/v1/responses", json={
            "model": "sql", "input": "hi", "max_output_tokens": 2})
        base = await client.post("/v1/chat/completions", json=chat("fake-model"))
        unknown = await client.post("/v1/chat/completions", json=chat("nope"))
    assert [r.json()["model"] for r in (chatted, completed, responded, base)] == \
        ["sql", "chat", "sql", "fake-model"]
    adapters = [(r.lora.name, r.lora.path) if r.HasField("lora") else None
                for r in gateway.fakes.engine.requests]
    assert adapters == [("sql", "/adapters/sql"), ("chat", "/adapters/chat"),
                        ("sql", "/adapters/sql"), None]
    assert chatted.json()["usage"]["prompt_tokens"] == base.json()["usage"]["prompt_tokens"]
    assert error_of(unknown, 404)["code"] == "model_not_found"


async def test_load_then_unload_through_the_endpoints(updatable):
    engine = updatable.fakes.engine
    async with updatable.client() as client:
        loaded = await client.post("/v1/load_lora_adapter", json=load("x", "/a/x"))
        listed = model_ids(await client.get("/v1/models"))
        served = await client.post("/v1/chat/completions", json=chat("x"))
        again = await client.post("/v1/load_lora_adapter", json=load("x", "/a/other"))
        unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
        after = model_ids(await client.get("/v1/models"))
        refused = await client.post("/v1/chat/completions", json=chat("x"))
        unknown = await client.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
    assert loaded.status_code == 200, loaded.text
    card = loaded.json()
    assert (card["id"], card["parent"], card["root"], card["rank"], card["target_modules"]) == \
        ("x", "fake-model", "/a/x", 8, ["q_proj", "v_proj"])
    assert listed == ["fake-model", "x"] and after == ["fake-model"]
    assert served.status_code == 200 and served.json()["model"] == "x"
    assert error_of(again, 400)["code"] == "lora_adapter_exists"
    assert unloaded.json() == {"id": "x", "object": "model", "deleted": True}
    assert engine.lora_calls == [("load", "x"), ("unload", "x")] and engine.lora_adapters == []
    assert error_of(refused, 404)["code"] == "model_not_found"
    assert error_of(unknown, 404)["param"] == "lora_name"


async def test_the_openai_client_loads_lists_chats_with_and_unloads_an_adapter(updatable):
    client = openai.AsyncOpenAI(base_url=f"{updatable.url}/v1", api_key="unused", max_retries=0)
    loaded = await client.post("/load_lora_adapter", body=load("x", "/a/x"), cast_to=object)
    listed = await client.models.list()
    completion = await client.chat.completions.create(**chat("x"))
    with pytest.raises(openai.BadRequestError):
        await client.post("/load_lora_adapter", body=load("x", "/a/x"), cast_to=object)
    await client.post("/unload_lora_adapter", body={"lora_name": "x"}, cast_to=object)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(**chat("x"))
    await client.close()
    assert loaded["id"] == "x" and completion.model == "x"
    assert [(m.id, getattr(m, "parent", None)) for m in listed.data] == \
        [("fake-model", None), ("x", "fake-model")]


async def test_a_bad_adapter_is_a_400_with_the_engines_message_and_stays_out(updatable):
    updatable.fakes.engine.unreadable_lora_paths.add("/a/broken")
    async with updatable.client() as client:
        response = await client.post("/v1/load_lora_adapter", json=load("x", "/a/broken"))
        listed = model_ids(await client.get("/v1/models"))
    assert error_of(response, 400)["message"] == "no adapter_config.json in /a/broken"
    assert listed == ["fake-model"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/load_lora_adapter", {"lora_path": "/a/x"}, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "x"}, "lora_path"),
    ("/v1/load_lora_adapter", load("x", ""), "lora_path"),
    ("/v1/load_lora_adapter", load("a b", "/a/x"), "lora_name"),
    ("/v1/load_lora_adapter", load("x", "/a/x", tenant="no spaces"), "tenant"),
    ("/v1/load_lora_adapter", load("fake-model", "/a/x"), "lora_name"),
    ("/v1/unload_lora_adapter", {}, "lora_name"),
])
async def test_a_missing_or_wrong_field_is_a_400_naming_it(updatable, path, body, param):
    async with updatable.client() as client:
        response = await client.post(path, json=body)
    assert error_of(response, 400)["param"] == param
    assert updatable.fakes.engine.lora_calls == []


async def test_with_keys_off_runtime_updates_are_refused_unless_allowed(gateway):
    async with gateway.client() as client:
        loading = await client.post("/v1/load_lora_adapter", json=load("x", "/a/x"))
        unloading = await client.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
    for response in (loading, unloading):
        error = error_of(response, 403)
        assert error["code"] == "permission_denied"
        assert "CONVEYOR_GATEWAY_ALLOW_RUNTIME_LORA_UPDATING" in error["message"]
    assert gateway.fakes.engine.lora_calls == []


async def test_with_keys_on_only_an_admins_key_may_load_or_unload(gateway_factory, key_of):
    gateway = await gateway_factory(auth_enabled=True, allow_runtime_lora_updating=True)
    admin, plain = await key_of("ops", admin=True), await key_of("acme")
    async with gateway.client() as client:
        anonymous = await client.post("/v1/load_lora_adapter", json=load("x", "/a/x"))
        refused = await client.post("/v1/load_lora_adapter", json=load("x", "/a/x"),
                                    headers=plain)
        loaded = await client.post("/v1/load_lora_adapter", json=load("x", "/a/x"),
                                   headers=admin)
        not_unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "x"},
                                         headers=plain)
        unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "x"},
                                     headers=admin)
    assert error_of(anonymous, 401)["code"] == "invalid_api_key"
    for response in (refused, not_unloaded):
        error = error_of(response, 403)
        assert (error["type"], error["code"]) == ("permission_denied_error", "permission_denied")
    assert loaded.status_code == 200 and unloaded.status_code == 200


async def test_a_tenants_adapter_is_invisible_to_other_tenants(gateway_factory, key_of):
    gateway = await gateway_factory(auth_enabled=True, lora_modules="sql=/adapters/sql")
    admin, acme, globex = (await key_of("ops", admin=True), await key_of("acme"),
                           await key_of("globex"))
    async with gateway.client() as client:
        loaded = await client.post("/v1/load_lora_adapter", headers=admin,
                                   json=load("acme-x", "/a/x", tenant="acme"))
        views = {name: (model_ids(await client.get("/v1/models", headers=headers)),
                        await client.get("/v1/models/acme-x", headers=headers),
                        await client.post("/v1/chat/completions", json=chat("acme-x"),
                                          headers=headers))
                 for name, headers in (("acme", acme), ("globex", globex), ("nobody", {}))}
    assert loaded.status_code == 200, loaded.text
    listed, card, served = views["acme"]
    assert listed == ["fake-model", "acme-x", "sql"]
    assert card.json()["id"] == "acme-x" and served.json()["model"] == "acme-x"
    listed, card, served = views["globex"]
    assert listed == ["fake-model", "sql"]
    assert error_of(card, 404)["code"] == error_of(served, 404)["code"] == "model_not_found"
    listed, card, _ = views["nobody"]  # no key: the public models only
    assert listed == ["fake-model", "sql"] and error_of(card, 404)["code"] == "model_not_found"


async def test_every_gateway_shares_the_catalog(gateway_factory):
    first = await gateway_factory(allow_runtime_lora_updating=True, lora_catalog_max_age_s=0)
    second = await gateway_factory(lora_catalog_max_age_s=60)
    async with first.client() as one, second.client() as other:
        assert model_ids(await other.get("/v1/models")) == ["fake-model"]  # listing cached
        await one.post("/v1/load_lora_adapter", json=load("x", "/a/x"))
        served = await other.post("/v1/chat/completions", json=chat("x"))
        await one.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
        gone = await one.post("/v1/chat/completions", json=chat("x"))
    assert served.status_code == 200 and served.json()["model"] == "x"
    assert error_of(gone, 404)["code"] == "model_not_found"


async def test_a_static_adapter_unloaded_stays_unloaded_when_a_gateway_starts(gateway_factory):
    first = await gateway_factory(lora_modules=STATIC, allow_runtime_lora_updating=True)
    async with first.client() as client:
        unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    restarted = await gateway_factory(lora_modules=STATIC + ",new=/adapters/new")
    async with restarted.client() as client:
        listed = model_ids(await client.get("/v1/models"))
    assert unloaded.status_code == 200
    assert listed == ["fake-model", "chat", "new"]


async def test_with_lora_off_on_every_engine_adapters_are_a_400_naming_the_model(
        gateway_factory):
    gateway = await gateway_factory(lora_modules=STATIC, allow_runtime_lora_updating=True)
    gateway.fakes.engine.max_loras = 0
    async with gateway.client() as client:
        refused = await client.post("/v1/chat/completions", json=chat("sql"))
        not_loaded = await client.post("/v1/load_lora_adapter", json=load("x", "/a/x"))
        base = await client.post("/v1/chat/completions", json=chat("fake-model"))
    for response in (refused, not_loaded):
        error = error_of(response, 400)
        assert error["code"] == "lora_not_served" and error["param"] == "model"
    assert "`sql` is a LoRA adapter" in refused.json()["error"]["message"]
    assert base.status_code == 200
    assert [r.HasField("lora") for r in gateway.fakes.engine.requests] == [False]


async def test_without_redis_models_lists_the_base_model_and_adapters_are_a_503(
        gateway_factory):
    gateway = await gateway_factory(redis_url="redis://127.0.0.1:1/0", lora_modules=STATIC,
                                    redis_timeout_s=0.2)
    async with gateway.client() as client:
        listed = model_ids(await client.get("/v1/models"))
        refused = await client.post("/v1/chat/completions", json=chat("sql"))
    assert listed == ["fake-model"]
    assert error_of(refused, 503)["code"] == "redis_unavailable"
