"""Routing across two real engine processes, through two real gateway processes.

- A conversation with an X-Session-ID (or a `user`) stays on one engine, whichever
  gateway takes each turn, and from the second turn its prompt hits that engine's
  prefix cache (cached_tokens > 0).
- When that engine dies, the session moves to the other one and keeps getting
  answers; both gateways agree on the new binding.

Until engines register themselves in Redis, the gateways find these engines through
CONVEYOR_GATEWAY_ENGINE_ADDRESSES (the registry fallback: an engine is live while it
answers Stats, under the id its Info reports). The engines are already given the
Redis settings they will read to register (CONVEYOR_ENGINE_REDIS_URL/_PREFIX), so
these tests then run over the registry unchanged.
"""

from __future__ import annotations

import uuid

import httpx
import pytest
from redis import Redis

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
ENGINE_IDS = ("e2e-engine-a", "e2e-engine-b")
SYSTEM = ("You are a terse assistant for a paint shop. Answer every question with one "
          "color name and nothing else, no punctuation, no explanation, no greeting, "
          "and never repeat a color you already gave in this conversation.")
"""Long enough that the first turn fills several 16-token KV blocks."""
QUESTIONS = ["Name a color.", "Another one.", "One more, please.", "And the next?"]


class Routing:
    """Two engines, two gateways over them, and the gateways' Redis namespace."""

    def __init__(self, engines, gateways, redis_url: str, prefix: str):
        self.engines = dict(zip(ENGINE_IDS, engines, strict=True))
        self.urls = [f"http://127.0.0.1:{g.port}" for g in gateways]
        self._redis_url = redis_url
        self._prefix = prefix

    def binding(self, session: str) -> str | None:
        """The engine id the session is bound to in Redis (what every gateway reads)."""
        client = Redis.from_url(self._redis_url, decode_responses=True)
        try:
            return client.get(f"{self._prefix}:route:session:{session}")
        finally:
            client.close()


@pytest.fixture(scope="module")
def routing(stack, module_launch):
    prefix = f"{stack.redis_prefix}:routing"
    redis = {"REDIS_URL": stack.redis_url, "REDIS_PREFIX": prefix}
    engines = module_launch.engines(*ENGINE_IDS, **redis)
    env = {"CONVEYOR_GATEWAY_ENGINE_ADDRESSES": ",".join(e.address for e in engines),
           "CONVEYOR_GATEWAY_REDIS_PREFIX": prefix}
    gateways = [module_launch.gateway(f"gateway-routing-{i}", **env) for i in range(2)]
    return Routing(engines, gateways, stack.redis_url, prefix)


class Conversation:
    """A chat whose turns go to alternating gateways; each turn's reply is kept."""

    def __init__(self, urls: list[str], session: str):
        self._clients = [httpx.Client(base_url=url, timeout=120) for url in urls]
        self.session = session
        self.messages = [{"role": "system", "content": SYSTEM}]

    def turn(self, number: int) -> httpx.Response:
        self.messages.append({"role": "user", "content": QUESTIONS[number % len(QUESTIONS)]})
        response = self._clients[number % len(self._clients)].post(
            "/v1/chat/completions", headers={"X-Session-ID": self.session},
            json={"model": MODEL, "messages": self.messages, "max_tokens": 3,
                  "temperature": 0})
        assert response.status_code == 200, response.text
        reply = response.json()["choices"][0]["message"]["content"]
        self.messages.append({"role": "assistant", "content": reply})
        return response

    def close(self) -> None:
        for client in self._clients:
            client.close()


def _engine_of(response: httpx.Response) -> str:
    return response.headers["x-conveyor-engine"]


def _cached_tokens(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_session_stays_on_its_engine_across_gateways_and_hits_its_prefix_cache(routing):
    conversation = Conversation(routing.urls, f"s-{uuid.uuid4().hex}")
    try:
        turns = [conversation.turn(i) for i in range(4)]
    finally:
        conversation.close()
    engines = {_engine_of(t) for t in turns}
    assert len(engines) == 1 and engines <= set(ENGINE_IDS)
    assert routing.binding(conversation.session) == engines.pop()
    assert all(_cached_tokens(t) > 0 for t in turns[1:]), [_cached_tokens(t) for t in turns]


def test_the_user_field_is_the_session_key_without_a_header(routing):
    user = f"u-{uuid.uuid4().hex}"
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "user": user}
    served = [httpx.post(f"{url}/v1/completions", json=body, timeout=60)
              for url in routing.urls * 2]
    assert all(r.status_code == 200 for r in served)
    assert len({_engine_of(r) for r in served}) == 1
    assert routing.binding(user) == _engine_of(served[0])


def test_a_session_moves_when_its_engine_dies_and_keeps_getting_answers(routing):
    conversation = Conversation(routing.urls, f"s-{uuid.uuid4().hex}")
    try:
        first = _engine_of(conversation.turn(0))
        routing.engines[first].kill()  # a crash: no drain, no goodbye
        moved = [conversation.turn(i) for i in range(1, 4)]
    finally:
        conversation.close()
    [survivor] = set(ENGINE_IDS) - {first}
    assert [_engine_of(t) for t in moved] == [survivor] * 3
    assert routing.binding(conversation.session) == survivor
    assert all(_cached_tokens(t) > 0 for t in moved[1:]), [_cached_tokens(t) for t in moved]
