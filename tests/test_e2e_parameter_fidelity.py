"""Every field of the openai SDK's chat and completions request schemas (read from the
SDK's own types), sent through the official SDK to the real stack: each is honoured,
has no effect by its own definition, or is refused with a 400 naming it, as docs/api.md
says; none is silently dropped. Then vLLM's shapes (echo, prompt_logprobs,
continuous_usage_stats, models.retrieve) and the requests LangChain and LiteLLM send.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI
from openai.types.chat.completion_create_params import CompletionCreateParamsBase as ChatParams
from openai.types.completion_create_params import CompletionCreateParamsBase as CompletionParams

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
API_DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"
MESSAGES = [{"role": "user", "content": "Write one short sentence about the sea."}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def client(stack) -> OpenAI:
    return OpenAI(base_url=stack.api_url, api_key="unused-locally", max_retries=0)


@dataclass(frozen=True)
class Case:
    """One value of a field: 400 naming the field when `refused`, else served, and then
    `check(result, ctx)` holds (the parsed response, or the chunks of a stream)."""

    value: object
    refused: bool = False
    check: Callable | None = None
    extra: dict | None = None
    """Other fields the case needs (stream for stream_options, logprobs for top_logprobs)."""


def _refused(value) -> Case:
    return Case(value, refused=True)


def _content(response) -> str:
    return response.choices[0].message.content or ""


def _timeline(ctx, raw) -> dict:
    request_id = raw.headers["x-request-id"]
    return httpx.get(f"{ctx.stack.api_url}/requests/{request_id}", timeout=10).json()


def _biased_token(ctx) -> int:
    tokens = httpx.post(f"{ctx.stack.base_url}/tokenize",
                        json={"prompt": "Hello", "add_special_tokens": False}).json()["tokens"]
    return tokens[0]


CHAT_CASES: dict[str, list[Case]] = {
    "audio": [_refused({"voice": "alloy", "format": "wav"})],
    "frequency_penalty": [Case(1.5)],
    "function_call": [_refused("auto")],
    "functions": [_refused([{"name": "f", "parameters": {"type": "object"}}])],
    "logit_bias": [Case("BIAS", check=lambda r, c, raw: _content(r).startswith("Hello"))],
    "logprobs": [Case(True, check=lambda r, c, raw: len(r.choices[0].logprobs.content) > 0)],
    "max_completion_tokens": [Case(2, check=lambda r, c, raw: r.usage.completion_tokens <= 2)],
    "max_tokens": [Case(3, check=lambda r, c, raw: r.usage.completion_tokens <= 3)],
    "messages": [Case(MESSAGES, check=lambda r, c, raw: bool(_content(r)))],
    "metadata": [Case({"case": "metadata"}, check=lambda r, c, raw: _timeline(c, raw)[
        "metadata"] == {"case": "metadata"})],
    "modalities": [Case(["text"]), _refused(["text", "audio"])],
    "model": [Case(MODEL, check=lambda r, c, raw: r.model == MODEL)],
    "moderation": [_refused({"model": "omni-moderation-latest"})],
    "n": [Case(2, check=lambda r, c, raw: len(r.choices) == 2)],
    "parallel_tool_calls": [Case(False, extra={"tools": [WEATHER_TOOL]})],
    "prediction": [_refused({"type": "content", "content": "The sea is blue."})],
    "presence_penalty": [Case(1.5)],
    "prompt_cache_key": [Case("fidelity-doc", check=lambda r, c, raw: bool(
        raw.headers["x-conveyor-engine"]))],
    "prompt_cache_options": [_refused({"mode": "explicit"})],
    "prompt_cache_retention": [Case("in_memory"), _refused("24h")],
    "reasoning_effort": [Case("low")],
    "response_format": [Case({"type": "text"})],
    "safety_identifier": [Case("user-7", check=lambda r, c, raw: _timeline(c, raw)[
        "safety_identifier"] == "user-7")],
    "seed": [Case(7, extra={"temperature": 1.0}, check=lambda r, c, raw: _content(r) == _content(
        c.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                         temperature=1.0, seed=7)))],
    "service_tier": [Case("flex", check=lambda r, c, raw: r.service_tier == "flex")],
    "stop": [Case(["."], extra={"max_tokens": 24}, check=lambda r, c, raw: "." not in _content(r))],
    "store": [Case(False), Case(True, check=lambda r, c, raw: c.client.chat.completions.retrieve(
        r.id).choices[0].message.content == _content(r))],
    "stream": [Case(True, check=lambda chunks, c, raw: len(chunks) > 1)],
    "stream_options": [Case({"include_usage": True}, extra={"stream": True},
                            check=lambda chunks, c, raw: chunks[-1].usage.completion_tokens > 0)],
    "temperature": [Case(0.0)],
    "tool_choice": [Case("none", extra={"tools": [WEATHER_TOOL]})],
    "tools": [Case([WEATHER_TOOL])],
    "top_logprobs": [Case(2, extra={"logprobs": True}, check=lambda r, c, raw: all(
        len(entry.top_logprobs) == 2 for entry in r.choices[0].logprobs.content))],
    "top_p": [Case(0.5)],
    "user": [Case("someone")],
    "verbosity": [Case("low")],
    "web_search_options": [_refused({})],
}
"""A case for every field of the SDK's chat schema (the test checks the SDK has no other)."""

PROMPT = "The sea is"
COMPLETION_CASES: dict[str, list[Case]] = {
    "best_of": [Case(2, extra={"n": 2}, check=lambda r, c, raw: len(r.choices) == 2),
                _refused(3)],
    "echo": [Case(True, check=lambda r, c, raw: r.choices[0].text.startswith(PROMPT))],
    "frequency_penalty": [Case(1.5)],
    "logit_bias": [Case("BIAS", check=lambda r, c, raw: r.choices[0].text.startswith("Hello"))],
    "logprobs": [Case(1, check=lambda r, c, raw: len(r.choices[0].logprobs.tokens) > 0)],
    "max_tokens": [Case(2, check=lambda r, c, raw: r.usage.completion_tokens <= 2)],
    "model": [Case(MODEL, check=lambda r, c, raw: r.model == MODEL)],
    "n": [Case(2, check=lambda r, c, raw: len(r.choices) == 2)],
    "presence_penalty": [Case(1.5)],
    "prompt": [Case(PROMPT, check=lambda r, c, raw: bool(r.choices[0].text))],
    "seed": [Case(11, extra={"temperature": 1.0}, check=lambda r, c, raw: r.choices[0].text == (
        c.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                    seed=11).choices[0].text))],
    "stop": [Case(["."], extra={"max_tokens": 24},
                  check=lambda r, c, raw: "." not in r.choices[0].text)],
    "stream": [Case(True, check=lambda chunks, c, raw: len(chunks) > 1)],
    "stream_options": [Case({"include_usage": True}, extra={"stream": True},
                            check=lambda chunks, c, raw: chunks[-1].usage.completion_tokens > 0)],
    "suffix": [_refused(" and that is all.")],
    "temperature": [Case(0.0)],
    "top_p": [Case(0.5)],
    "user": [Case("someone")],
}


@dataclass
class Context:
    stack: object
    client: OpenAI


def _documented(section: str) -> dict[str, str]:
    """field -> status, from the table of docs/api.md under the heading `section`."""
    text = API_DOC.read_text().split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in
            re.finditer(r"^\| `(\w+)` \| (supported|no effect|refused|extra \(vLLM\)) \|",
                        text, re.MULTILINE)}


def _sdk_fields(params) -> set[str]:
    return set(params.__annotations__) | {"stream"}


@pytest.mark.parametrize(("params", "cases", "section"), [
    (ChatParams, CHAT_CASES, "Chat completions"),
    (CompletionParams, COMPLETION_CASES, "Completions"),
], ids=["chat", "completions"])
def test_every_sdk_field_is_classified_and_documented(params, cases, section):
    fields = _sdk_fields(params)
    assert set(cases) == fields, f"unclassified: {sorted(fields - set(cases))}"
    documented = _documented(section)
    assert fields <= set(documented), f"undocumented: {sorted(fields - set(documented))}"
    for name in fields:
        assert documented[name] in ("supported", "no effect", "refused"), name
        assert all(case.refused for case in cases[name]) == (documented[name] == "refused"), name


@pytest.mark.parametrize("field", sorted(CHAT_CASES))
def test_each_chat_field_is_honoured_or_refused(stack, client, field):
    base = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0.0}
    _run_cases(Context(stack, client), client.chat.completions, base, field, CHAT_CASES[field])


@pytest.mark.parametrize("field", sorted(COMPLETION_CASES))
def test_each_completions_field_is_honoured_or_refused(stack, client, field):
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    _run_cases(Context(stack, client), client.completions, base, field,
               COMPLETION_CASES[field])


def _run_cases(ctx: Context, api, base: dict, field: str, cases: list[Case]) -> None:
    for case in cases:
        value = {str(_biased_token(ctx)): 100} if case.value == "BIAS" else case.value
        kwargs = {**base, **(case.extra or {}), field: value}
        if case.refused:
            with pytest.raises(BadRequestError) as caught:
                api.create(**kwargs)
            assert caught.value.body["param"] == field, caught.value.body
            assert caught.value.body["code"] == "unsupported_parameter"
            continue
        raw = api.with_raw_response.create(**kwargs)
        result = raw.parse()
        if kwargs.get("stream"):
            result = list(result)
        assert case.check is None or case.check(result, ctx, raw), (field, case.value)


# -- vLLM's shapes ------------------------------------------------------------------------

def test_echo_with_logprobs_prepends_the_prompt_and_its_logprobs(client):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                         temperature=0, echo=True, logprobs=2)
    [choice] = response.choices
    logprobs = choice.logprobs
    assert choice.text.startswith(PROMPT)
    num_prompt = response.usage.prompt_tokens
    assert "".join(logprobs.tokens[:num_prompt]) == PROMPT
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(len(top) == 2 for top in logprobs.top_logprobs[1:])
    assert len(logprobs.tokens) == num_prompt + response.usage.completion_tokens
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0


def test_prompt_logprobs_agree_with_the_logprobs_of_sampling(stack, client):
    """The logprob vLLM's prompt_logprobs gives a prompt token equals the one the engine
    gave it when it sampled that token: the same distribution, read the other way."""
    sampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                        temperature=0, logprobs=1)
    token_logprob = sampled.choices[0].logprobs.token_logprobs[0]
    extended = PROMPT + sampled.choices[0].text
    response = client.completions.create(model=MODEL, prompt=extended, max_tokens=1,
                                         temperature=0, extra_body={"prompt_logprobs": 3})
    entries = response.choices[0].model_extra["prompt_logprobs"]
    tokens = httpx.post(f"{stack.base_url}/tokenize", json={"prompt": extended}).json()["tokens"]
    assert len(entries) == len(tokens) and entries[0] is None
    for token_id, entry in zip(tokens[1:], entries[1:], strict=True):
        assert str(token_id) in entry  # the prompt's token, with the top 3
        assert {"logprob", "rank", "decoded_token"} == set(entry[str(token_id)])
        assert {1, 2, 3} <= {e["rank"] for e in entry.values()}
    last = entries[-1][str(tokens[-1])]
    assert last["logprob"] == pytest.approx(token_logprob, abs=1e-3) and last["rank"] == 1


def test_chat_prompt_logprobs_are_a_field_of_the_response(client):
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                              temperature=0, extra_body={"prompt_logprobs": 0})
    entries = response.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == response.usage.prompt_tokens
    assert all(len(entry) == 1 for entry in entries[1:])  # the prompt's token alone


def test_return_token_ids_are_the_prompts_and_the_outputs_tokens(stack, client):
    """vLLM's return_token_ids: the prompt's ids are the tokenizer's, the output's decode
    to the choice's text, and a stream's ids add up to the same tokens."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "extra_body": {"return_token_ids": True}}
    choice = client.completions.create(**body).choices[0].model_extra
    tokens = httpx.post(f"{stack.base_url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert choice["prompt_token_ids"] == tokens and len(choice["token_ids"]) == 8
    text = httpx.post(f"{stack.base_url}/detokenize",
                      json={"tokens": choice["token_ids"]}).json()["prompt"]
    assert text == client.completions.create(**body).choices[0].text
    chunks = list(client.completions.create(**body, stream=True))
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == tokens
    streamed = [t for chunk in chunks for c in chunk.choices for t in c.model_extra["token_ids"]]
    assert streamed == choice["token_ids"]


def test_return_tokens_as_token_ids_names_the_sampled_ids(client):
    choice = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True}).choices[0]
    ids = choice.model_extra["token_ids"]
    assert choice.logprobs.tokens == [f"token_id:{i}" for i in ids]


def test_allowed_token_ids_are_all_a_choice_samples(client):
    allowed = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                         temperature=0, extra_body={"return_token_ids": True})
               .choices[0].model_extra["token_ids"][0] + 1, 11, 12, 13]  # not the argmax
    for temperature in (0, 1):
        choice = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, temperature=temperature,
            extra_body={"allowed_token_ids": allowed, "return_token_ids": True}).choices[0]
        assert set(choice.model_extra["token_ids"]) <= set(allowed), temperature
    with pytest.raises(BadRequestError, match="allowed_token_ids cannot be combined"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                  extra_body={"allowed_token_ids": allowed,
                                              "guided_choice": ["yes", "no"]})


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(stack, client):
    prompt = "Rivers carry water from the mountains to the sea, past towns and fields."
    tokens = httpx.post(f"{stack.base_url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    kept = httpx.post(f"{stack.base_url}/detokenize", json={"tokens": tokens[-5:]}).json()
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True,
                                         extra_body={"truncate_prompt_tokens": 5})
    assert response.usage.prompt_tokens == 5
    assert response.choices[0].text.startswith(kept["prompt"])  # echo shows what was read
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 8})
    assert chat.usage.prompt_tokens == 8


def test_documents_reach_the_prompt_of_a_template_without_them(client):
    """The bundled template has no place for documents: they are written into the system
    message, and the model reads them."""
    document = {"title": "Harbour log", "text": "The ferry Aurora left pier nine at 6:40."}

    def prompt_tokens(**extra) -> int:
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                              **extra).usage.prompt_tokens

    assert prompt_tokens(extra_body={"documents": [document]}) >= prompt_tokens() + 15


def test_bad_words_never_complete_in_the_output(stack, client):
    """The greedy output's first word, banned: neither of its token sequences (as written,
    and after a space) appears in the new output."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    first = client.completions.create(**body).choices[0].text.split()[0]
    choice = client.completions.create(**body, extra_body={
        "bad_words": [first], "return_token_ids": True}).choices[0]
    out = choice.model_extra["token_ids"]
    for text in (first, " " + first):
        banned = httpx.post(f"{stack.base_url}/tokenize", json={
            "prompt": text, "add_special_tokens": False}).json()["tokens"]
        assert not any(out[i:i + len(banned)] == banned for i in range(len(out))), text


def test_chat_echo_shows_the_continued_assistant_turn(client):
    messages = [*MESSAGES, {"role": "assistant", "content": "The sea is"}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0,
        extra_body={"echo": True, "continue_final_message": True,
                    "add_generation_prompt": False})
    assert response.choices[0].message.content.startswith("The sea is")
    assert len(response.choices[0].message.content) > len("The sea is")


def test_tokenize_counts_a_conversation_with_tools_as_chat_does(stack, client):
    """vLLM's /tokenize takes chat's template fields: its count is the prompt_tokens the
    same conversation with tools and documents is billed."""
    extra = {"tools": [WEATHER_TOOL], "documents": [{"text": "Rain in Oslo today."}]}
    counted = httpx.post(f"{stack.base_url}/tokenize",
                         json={"messages": MESSAGES, **extra}).json()["count"]
    plain = httpx.post(f"{stack.base_url}/tokenize", json={"messages": MESSAGES}).json()["count"]
    served = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                            tools=extra["tools"],
                                            extra_body={"documents": extra["documents"]})
    assert counted == served.usage.prompt_tokens > plain


def test_cache_salt_keeps_cached_prefixes_apart(client):
    """vLLM's cache_salt: a prompt cached under one salt is a hit again under that salt
    only."""
    prompt = ("A lighthouse keeper counts the ships that pass each night and writes their "
              "names in a book; tonight the fog is thick and the count is low. " * 2)

    def cached(salt: str) -> int:
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                             extra_body={"cache_salt": salt})
        return response.usage.prompt_tokens_details.cached_tokens or 0

    first = cached("salt-a")
    assert cached("salt-a") >= first + 16  # a block or more, cached under its salt
    assert cached("salt-b") == 0


def test_continuous_usage_stats_count_every_chunk(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    usages = [chunk.usage for chunk in chunks]
    assert all(usage is not None for usage in usages)
    prompt_tokens = usages[-1].prompt_tokens
    counts = [usage.completion_tokens for usage in usages]
    assert all(u.prompt_tokens == prompt_tokens and u.total_tokens == prompt_tokens
               + u.completion_tokens for u in usages)
    assert counts == sorted(counts) and counts[-1] == usages[-2].completion_tokens > 0


def test_models_retrieve(client):
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "conveyor")
    assert model.model_extra["max_model_len"] > 0 and model.model_extra["root"] == MODEL
    with pytest.raises(NotFoundError):
        client.models.retrieve("no-such-model")


# -- what frameworks send ---------------------------------------------------------------

def test_langchain_chat_openai_requests_pass(stack):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=stack.api_url, api_key="unused-locally", model=MODEL,
                     max_tokens=8, temperature=0, max_retries=0, stream_usage=True)
    assert llm.invoke("Say hi.").content
    assert "".join(chunk.content for chunk in llm.stream("Say hi."))
    tooled = llm.bind_tools([WEATHER_TOOL], tool_choice="auto")
    assert tooled.invoke("Weather in Paris?") is not None


@pytest.mark.parametrize("body", [
    # LiteLLM's OpenAI-compatible provider: provider extras merged into the body
    {"messages": MESSAGES, "max_tokens": 8, "temperature": 0.2, "top_p": 0.9, "stream": False,
     "user": "litellm-user", "top_k": 20},
    {"messages": MESSAGES, "max_tokens": 8, "stream": True,
     "stream_options": {"include_usage": True}},
    # the SDK's own defaults spelled out
    {"messages": MESSAGES, "max_completion_tokens": 8, "n": 1, "stop": None, "seed": None,
     "tools": None, "tool_choice": None, "response_format": None},
], ids=["litellm", "litellm-stream", "sdk-nulls"])
def test_framework_shaped_requests_pass(stack, body):
    response = httpx.post(f"{stack.api_url}/chat/completions", json={"model": MODEL, **body},
                          timeout=60)
    assert response.status_code == 200, response.text
