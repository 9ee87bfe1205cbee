"""The request path stays readable: the gateway modules one streamed chat request (API
keys on) passes through are counted, and the count is held to the architecture's budget."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from conveyor.gateway.tenancy.api_keys import ApiKeyStore
from conveyor.gateway.tenancy.tiers import DEFAULT_TIERS

MAX_MODULES = 27
"""docs/architecture.md, "One streamed chat request, hop by hop": the gateway's files by
job (api/, clients/, routing/, tenancy/, endpoints: issue 31), each module small and of one
job; 13 before that split, in fewer and larger modules; 27 since the response's writer left
routes.py (which was at its 400-line bound) for a module of its own."""

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5, "stream": True}


@contextmanager
def gateway_modules_called() -> Iterator[set[str]]:
    """The conveyor.gateway modules whose functions run inside the block (this thread)."""
    seen: set[str] = set()

    def profile(frame, event, _arg):
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.startswith("conveyor.gateway"):
                seen.add(module)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(previous)


async def test_one_streamed_request_passes_through_at_most_its_budget_of_modules(
        gateway_factory, redis, prefix):
    gateway = await gateway_factory(auth_enabled=True)
    key = (await ApiKeyStore(redis, DEFAULT_TIERS, prefix=prefix).create("acme", "standard")).key
    headers = {"Authorization": f"Bearer {key}"}
    async with gateway.client(headers=headers) as client:
        warm = await client.post("/v1/chat/completions", json=CHAT)  # caches warm
        assert warm.status_code == 200
        with gateway_modules_called() as modules:
            response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    print(f"{len(modules)} gateway modules: {sorted(modules)}")
    assert len(modules) <= MAX_MODULES, sorted(modules)
