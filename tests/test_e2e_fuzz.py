"""Issue 15's battery over the real pipeline (real tokenizer, engine, detok): every body
that once got a 5xx now gets a 4xx OpenAI error, the 20 MB prompt is refused at once, and
a short derandomized hypothesis run of bodies finds no 5xx. The wide fuzz (schemathesis
and hypothesis) runs over fakes in services/gateway/tests/test_fuzz_*.py."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
SURROGATE = "\ud800"
BATTERY = [
    ("/v1/completions", {**COMPLETION, "prompt": [2**32]}),
    ("/v1/completions", {**COMPLETION, "prompt": [[1, 2**32 + 5]]}),
    ("/v1/completions", {**COMPLETION, "prompt": [60_000]}),
    ("/v1/completions", {**COMPLETION, "prompt": SURROGATE}),
    ("/detokenize", {"tokens": [2**32]}),
    ("/detokenize", {"tokens": [60_000]}),
    ("/v1/chat/completions", {**CHAT, "top_k": 2**31}),
    ("/v1/chat/completions", {**CHAT, "min_tokens": 2**32}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2**32}),
    ("/v1/chat/completions", {**CHAT, "min_tokens": 5}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": SURROGATE}]}),
    ("/v1/chat/completions", {**CHAT, "user": SURROGATE}),
    ("/v1/chat/completions", {**CHAT, "stop": SURROGATE}),
    ("/v1/chat/completions", {**CHAT, "model": SURROGATE}),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"²": 1}}),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"60000": 1}}),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "5"}),
    ("/v1/chat/completions", {**CHAT, "chat_template": "{% for x in y %}"}),
    ("/v1/chat/completions", {**CHAT, "tools": [[[]]] * 3}),
    ("/tokenize", {"prompt": SURROGATE}),
]


def post(client: httpx.Client, path: str, body: object) -> httpx.Response:
    """POST `body` as ASCII JSON (escapes such as \\\\ud800 go out as written)."""
    return client.post(path, content=json.dumps(body).encode(),
                       headers={"content-type": "application/json"})


def assert_client_error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.base_url, timeout=120) as client:
        yield client


@pytest.mark.parametrize(("path", "body"), BATTERY, ids=[str(i) for i in range(len(BATTERY))])
def test_bodies_that_were_5xx_are_400_over_the_real_services(http, path, body):
    assert_client_error(post(http, path, body))


def test_a_20_mb_prompt_is_413_at_once(http):
    started = time.monotonic()
    response = post(http, "/v1/completions", {**COMPLETION, "prompt": "word " * 4_000_000})
    assert assert_client_error(response, 413)["code"] == "request_too_large"
    assert time.monotonic() - started < 5


def test_a_prompt_past_the_tokenizers_character_limit_is_400_at_once(http):
    started = time.monotonic()
    response = post(http, "/v1/completions", {**COMPLETION, "prompt": "word " * 200_000})
    assert "characters" in assert_client_error(response)["message"]
    assert time.monotonic() - started < 5


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                    st.sampled_from(["", "hi", SURROGATE, "²", 2**32, -1, 2**63]),
                    st.lists(st.integers(0, 2**33), max_size=3))
_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "n", "stop", "stop_token_ids",
           "seed", "logit_bias", "min_tokens", "user", "priority", "stream", "logprobs",
           "top_logprobs", "prompt", "repetition_penalty", "allowed_token_ids", "bad_words"]


@settings(max_examples=40, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(overrides=st.dictionaries(st.sampled_from(_FIELDS), _VALUES, max_size=3))
def test_fuzzed_completion_bodies_over_the_real_services_are_never_5xx(http, overrides):
    body = {**COMPLETION, **overrides}
    if body.get("max_tokens") is None:  # null: the rest of the context, minutes on a busy
        body["max_tokens"] = 2          # 2-core machine, ending in the deadline's 504
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 2)  # short generations only
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
        body["n"] = min(body["n"], 2)
    response = post(http, "/v1/completions", body)
    assert response.status_code < 500, response.text


async def test_the_engine_is_idle_after_the_battery(idle_engine):
    stats = await idle_engine(30.0)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks
