"""No client input reaches a 5xx: the hand-made battery of issue 15 (each body once a
500 or a coerced value) and hypothesis-generated bodies, against the gateway over fakes.

Every refusal is a 4xx OpenAI error body naming the parameter where there is one."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5}
COMPLETION = {"model": "fake-model", "prompt": "hi", "max_tokens": 5}
SURROGATE = "\ud800"


async def post(client: httpx.AsyncClient, path: str, body: object) -> httpx.Response:
    """POST `body` as ASCII JSON (escapes such as \\ud800 go out as written)."""
    return await client.post(path, content=json.dumps(body).encode(),
                             headers={"content-type": "application/json"})


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(("patch", "param"), [
    ({"max_tokens": 2**32}, "max_tokens"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"max_completion_tokens": 2**32}, "max_completion_tokens"),
    ({"top_k": 2**31}, "top_k"),
    ({"min_tokens": 2**32}, "min_tokens"),
    ({"n": 2**40}, "n"),
    ({"priority": 2**40}, "priority"),
    ({"seed": 2**64}, "seed"),
    ({"stop_token_ids": [2**32]}, "stop_token_ids.0"),
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 5.0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
    ({"logprobs": "true"}, "logprobs"),
    ({"logit_bias": {"²": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"4294967296": 1}}, "logit_bias"),
    ({"logit_bias": {"1": "5"}}, "logit_bias.1"),
    ({"messages": [{"role": "user", "content": SURROGATE}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
     "messages.0.content.0.text"),
    ({"user": SURROGATE}, "user"),
    ({"stop": SURROGATE}, "stop"),
    ({"stop": ["ok", SURROGATE]}, "stop.1"),
    ({"model": SURROGATE}, "model"),
    ({"chat_template_kwargs": {SURROGATE: 1}}, "chat_template_kwargs.\\ud800"),
])
async def test_chat_bodies_that_were_5xx_or_coerced_are_400(gateway, patch, param):
    async with gateway.client() as client:
        response = await post(client, "/v1/chat/completions", {**CHAT, **patch})
    assert error_of(response)["param"] == param


@pytest.mark.parametrize(("patch", "param"), [
    ({"prompt": [2**32]}, "prompt"),
    ({"prompt": [[1, 2**32]]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": SURROGATE}, "prompt"),
    ({"prompt": ["fine", SURROGATE]}, "prompt.1"),
    ({"prompt": [1.5]}, "prompt"),
    ({"prompt": True}, "prompt"),
])
async def test_completion_bodies_that_were_5xx_are_400(gateway, patch, param):
    async with gateway.client() as client:
        response = await post(client, "/v1/completions", {**COMPLETION, **patch})
    assert error_of(response)["param"] == param


@pytest.mark.parametrize(("path", "body"), [
    ("/detokenize", {"tokens": [2**32]}),
    ("/detokenize", {"tokens": [-1]}),
    ("/detokenize", {"tokens": ["1"]}),
    ("/tokenize", {"prompt": SURROGATE}),
    ("/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]}),
])
async def test_tokenize_and_detokenize_bodies_are_400(gateway, path, body):
    async with gateway.client() as client:
        response = await post(client, path, body)
    error_of(response)


@pytest.mark.parametrize("raw", [
    b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], '
    b'"temperature": NaN}',
    b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], '
    b'"presence_penalty": -Infinity}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"messages": [{"role": "user", "content": "hi"}], "tools": ' + b"[" * 100_000
    + b"]" * 100_000 + b"}",
    b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
], ids=["nan", "infinity", "5000-digit-int", "deep-nesting", "invalid-utf8"])
async def test_raw_bodies_json_cannot_hold_are_400(gateway, raw):
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", content=raw,
                                     headers={"content-type": "application/json"})
    error_of(response)


async def test_nesting_json_can_hold_is_not_a_5xx(gateway):
    nested: object = "leaf"
    for _ in range(400):
        nested = {"k": nested}
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions",
                                     json={**CHAT, "chat_template_kwargs": {"deep": nested}})
    assert response.status_code < 500, response.text


async def test_valid_integer_edges_are_served(gateway):
    body = {**CHAT, "top_k": 2**31 - 1, "seed": 2**63 - 1, "stop_token_ids": [0, 999],
            "logit_bias": {" 7 ": 1.5}, "min_tokens": 0}
    async with gateway.client() as client:
        response = await client.post("/v1/chat/completions", json=body)
        too_long = await client.post("/v1/chat/completions",
                                     json={**CHAT, "max_tokens": 2**32 - 1})
    assert response.status_code == 200, response.text
    assert error_of(too_long)["code"] == "context_length_exceeded"


async def test_a_body_over_the_limit_is_413_before_it_is_read(gateway_factory):
    gateway = await gateway_factory(max_body_bytes=1000)
    async with gateway.client() as client:
        declared = await client.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 2000})
        small_chunked = await client.post("/v1/completions", content=_chunks(
            json.dumps(COMPLETION)), headers={"content-type": "application/json"})
    assert error_of(declared, 413)["code"] == "request_too_large"
    assert small_chunked.status_code == 200, small_chunked.text
    status, body = await _chunked_beyond_the_limit(gateway.url, num_bytes=1100)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"


async def _chunks(text: str):
    """A body without Content-Length (chunked transfer encoding), 100 bytes a chunk."""
    data = text.encode()
    for start in range(0, len(data), 100):
        yield data[start:start + 100]


async def _chunked_beyond_the_limit(url: str, num_bytes: int) -> tuple[int, bytes]:
    """Send `num_bytes` of a chunked body that never ends; the status and body of the
    answer (the gateway must answer without waiting for the rest)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    chunk = b"x" * 100
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                 b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                 + b"64\r\n" + chunk + b"\r\n" * 1)
    writer.write((b"64\r\n" + chunk + b"\r\n") * (num_bytes // 100 - 1))
    await writer.drain()
    response = await asyncio.wait_for(reader.read(), timeout=10)
    writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


_EDGE_INTS = st.sampled_from([-(2**63) - 1, -(2**31) - 1, -1, 0, 1, 2**31 - 1, 2**31,
                              2**32 - 1, 2**32, 2**63, 2**64, 10**30])
_EDGE_FLOATS = st.sampled_from([-1e308, -2.5, -0.0, 0.5, 1.0, 2.0, 2.5, 1e30, 1e308])
_EDGE_TEXT = st.sampled_from(["", " ", "hi", SURROGATE, "a\udc00b", "²", "7", "\x00", "💥"])
_SCALARS = st.one_of(st.none(), st.booleans(), _EDGE_INTS, st.integers(), _EDGE_FLOATS,
                     st.floats(allow_nan=False), _EDGE_TEXT, st.text(max_size=8))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(_EDGE_TEXT | st.text(max_size=4), inner,
                                                 max_size=3)), max_leaves=8)
_FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
           "min_p", "n", "stop", "stop_token_ids", "seed", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos", "min_tokens",
           "user", "priority", "stream", "stream_options", "logprobs", "top_logprobs", "tools",
           "chat_template_kwargs", "add_special_tokens", "skip_special_tokens"]
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "wizard"]),
                                  "content": _VALUES})
_OVERRIDES = st.dictionaries(st.sampled_from(_FIELDS), _VALUES, max_size=4)
FUZZ = settings(max_examples=300, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def _assert_not_5xx(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@FUZZ
@given(messages=st.one_of(st.lists(_MESSAGE, max_size=2), _VALUES), overrides=_OVERRIDES)
def test_fuzzed_chat_bodies_are_never_5xx(threaded_gateway, messages, overrides):
    body = {**CHAT, "max_tokens": 4, "messages": messages, **overrides}
    with httpx.Client(base_url=threaded_gateway.url, timeout=30) as client:
        _assert_not_5xx(client.post("/v1/chat/completions", content=json.dumps(body).encode(),
                                    headers={"content-type": "application/json"}))


@FUZZ
@given(prompt=_VALUES, overrides=_OVERRIDES)
def test_fuzzed_completion_bodies_are_never_5xx(threaded_gateway, prompt, overrides):
    body = {**COMPLETION, "max_tokens": 4, "prompt": prompt, **overrides}
    with httpx.Client(base_url=threaded_gateway.url, timeout=30) as client:
        _assert_not_5xx(client.post("/v1/completions", content=json.dumps(body).encode(),
                                    headers={"content-type": "application/json"}))
