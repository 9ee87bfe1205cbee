"""Multi-LoRA end to end through the official openai client (issue 34): a real engine with
LoRA on (float32), its own gateway with API keys on, the real model and Redis.

- models.list() shows the base model and the static adapter (CONVEYOR_GATEWAY_LORA_MODULES)
  with `parent` the base model.
- Base and adapter chat requests in flight together answer as each does alone; the adapter's
  answer differs from the base model's; each response names the model asked for.
- The adapter's greedy completion equals transformers' with the adapter merged by peft.
- An admin's key loads an adapter at run time (another key gets 403): it is listed and
  serves; unloaded, it is gone from the list and a request naming it is 404.
- An adapter loaded for tenant A: A sees and uses it, tenant B neither sees it nor uses it.
- Afterwards the engine runs and queues nothing, every KV block is free, and it holds no
  adapter that was unloaded.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import openai
import pytest
from redis.asyncio import Redis

from conveyor.common.grpc_client import open_channel
from conveyor.gateway.clients.engine import EngineClient
from conveyor.gateway.tenancy.api_keys import ApiKeyStore
from conveyor.gateway.tenancy.tiers import build_tiers

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PROMPT_IDS = [504, 2988, 288, 451, 8170, 314]
MAX_TOKENS = 8
CHAT = [{"role": "user", "content": "Name three colours."}]


@dataclass(frozen=True)
class LoraStack:
    """The LoRA engine behind its own gateway, two adapter folders, keys by tenant."""

    api_url: str
    engine_address: str
    static_adapter: str
    """Served as `tuned` from the gateway's CONVEYOR_GATEWAY_LORA_MODULES."""
    runtime_adapter: str
    """Loaded through the admin endpoints."""
    keys: dict[str, str]
    """API keys of `ops` (an admin), `tenant-a` and `tenant-b`."""

    def client(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.api_url, api_key=self.keys[tenant], max_retries=0,
                             timeout=120)

    def async_client(self, tenant: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.api_url, api_key=self.keys[tenant],
                                  max_retries=0, timeout=300)


async def _create_keys(redis_url: str, prefix: str) -> dict[str, str]:
    redis = Redis.from_url(redis_url, decode_responses=True)
    try:
        store = ApiKeyStore(redis, build_tiers({}), prefix=prefix)
        return {tenant: (await store.create(tenant, "standard", admin=tenant == "ops")).key
                for tenant in ("ops", "tenant-a", "tenant-b")}
    finally:
        await redis.aclose()


@pytest.fixture(scope="module")
def lora(module_launch, stack, make_lora_adapter) -> LoraStack:
    static, runtime = make_lora_adapter.make(8, seed=1), make_lora_adapter.make(8, seed=2)
    [engine] = module_launch.engines("engine-lora", ENABLE_LORA="true", MAX_LORAS="2",
                                     MAX_LORA_RANK="8")
    prefix = f"{stack.redis_prefix}:lora"  # this module's catalog and keys alone
    gateway = module_launch.gateway(
        "gateway-lora", CONVEYOR_GATEWAY_ENGINE_ADDRESSES=engine.address,
        CONVEYOR_GATEWAY_REDIS_PREFIX=prefix, CONVEYOR_GATEWAY_AUTH_ENABLED="true",
        CONVEYOR_GATEWAY_LORA_MODULES=f"tuned={static}")
    return LoraStack(f"http://127.0.0.1:{gateway.port}/v1", engine.address, static, runtime,
                     asyncio.run(_create_keys(stack.redis_url, prefix)))


def _models(client: openai.OpenAI) -> dict[str, str | None]:
    """{id: parent} of the models the client's key may use."""
    return {model.id: model.model_extra["parent"] for model in client.models.list()}


def _complete(client: openai.OpenAI, model: str) -> openai.types.Completion:
    return client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=MAX_TOKENS,
                                     temperature=0)


def test_models_lists_the_static_adapter_under_the_base_model(lora):
    assert _models(lora.client("tenant-a")) == {MODEL: None, "tuned": MODEL}


async def test_base_and_adapter_in_flight_together_answer_as_each_alone(lora):
    client = lora.async_client("tenant-a")

    async def ask(model: str) -> str:
        response = await client.chat.completions.create(
            model=model, messages=CHAT, temperature=0, max_tokens=MAX_TOKENS)
        assert response.model == model
        return response.choices[0].message.content

    alone = {model: await ask(model) for model in (MODEL, "tuned")}
    assert alone["tuned"] != alone[MODEL] and all(alone.values()), alone
    order = [MODEL, "tuned"] * 3
    assert await asyncio.gather(*(ask(model) for model in order)) == [alone[m] for m in order]
    await client.close()


def test_adapter_greedy_completion_equals_transformers_with_peft_merged(lora,
                                                                        make_lora_adapter):
    import torch
    from transformers import AutoTokenizer

    from conveyor.engine.model.loader import resolve_checkpoint

    served = _complete(lora.client("tenant-a"), "tuned")
    reference = make_lora_adapter.reference(lora.static_adapter)
    prompt = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        output = reference.generate(prompt, attention_mask=torch.ones_like(prompt),
                                    max_new_tokens=MAX_TOKENS, do_sample=False)
    tokens = output[0, len(PROMPT_IDS):].tolist()
    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint(MODEL))
    assert served.model == "tuned"
    assert served.choices[0].text == tokenizer.decode(tokens, skip_special_tokens=True) != ""
    assert served.usage.completion_tokens == len(tokens)


def test_an_admin_loads_and_unloads_an_adapter_at_run_time(lora):
    admin, user = lora.client("ops"), lora.client("tenant-a")
    body = {"lora_name": "runtime", "lora_path": lora.runtime_adapter}
    with pytest.raises(openai.PermissionDeniedError):
        user.post("/load_lora_adapter", body=body, cast_to=object)
    card = admin.post("/load_lora_adapter", body=body, cast_to=object)
    assert (card["id"], card["parent"], card["rank"]) == ("runtime", MODEL, 8)
    assert _models(user)["runtime"] == MODEL
    served = _complete(user, "runtime")
    assert served.model == "runtime" and served.choices[0].text != _complete(user, MODEL) \
        .choices[0].text
    unloaded = admin.post("/unload_lora_adapter", body={"lora_name": "runtime"},
                          cast_to=object)
    assert unloaded == {"id": "runtime", "object": "model", "deleted": True}
    assert "runtime" not in _models(user)
    with pytest.raises(openai.NotFoundError):
        _complete(user, "runtime")


def test_a_tenants_adapter_is_that_tenants_alone(lora):
    admin, owner, other = (lora.client(t) for t in ("ops", "tenant-a", "tenant-b"))
    admin.post("/load_lora_adapter", cast_to=object, body={
        "lora_name": "a-only", "lora_path": lora.runtime_adapter, "tenant": "tenant-a"})
    assert _models(owner) == {MODEL: None, "tuned": MODEL, "a-only": MODEL}
    assert _complete(owner, "a-only").model == "a-only"
    assert _models(other) == {MODEL: None, "tuned": MODEL}
    with pytest.raises(openai.NotFoundError):
        _complete(other, "a-only")
    admin.post("/unload_lora_adapter", body={"lora_name": "a-only"}, cast_to=object)


async def test_the_engine_is_idle_and_holds_no_unloaded_adapter(lora):
    channel = open_channel(lora.engine_address)
    engine = EngineClient(lora.engine_address, channel, rpc_timeout_s=5)
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        stats = await engine.stats()
        idle = (stats.num_running, stats.num_waiting, stats.num_free_blocks) == \
            (0, 0, stats.num_blocks)
        if idle or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.02)
    await channel.close()
    assert idle, stats
    assert "tuned" in stats.lora_adapters
    assert not {"runtime", "a-only"} & set(stats.lora_adapters), stats
