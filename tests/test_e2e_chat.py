"""End to end with the official `openai` client: chat and completions, streaming
and not, usage, n, stop strings, seeds, max_tokens. Real processes and model."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
HELLO = [{"role": "user", "content": "Say hello in five words."}]


def test_chat_completion(openai_client):
    response = openai_client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
    [choice] = response.choices
    assert response.object == "chat.completion" and response.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.prompt_tokens > 5
    assert 0 < response.usage.completion_tokens <= 8
    assert response.usage.total_tokens == (response.usage.prompt_tokens
                                           + response.usage.completion_tokens)


def test_chat_streaming_equals_non_streaming_and_reports_usage(openai_client):
    whole = openai_client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
    chunks = list(openai_client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]


def test_completion_streaming_and_not(openai_client):
    prompt = "The capital of France is"
    whole = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                             temperature=0)
    chunks = list(openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                                   temperature=0, stream=True))
    assert whole.object == "text_completion" and whole.choices[0].text
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_max_tokens_ends_with_finish_reason_length(openai_client):
    response = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a long story."}],
        max_tokens=3, temperature=0)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 3


def test_n_two_choices_streamed_and_not(openai_client):
    whole = openai_client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=6, n=2, temperature=1.0, seed=11)
    assert [c.index for c in whole.choices] == [0, 1]
    assert all(c.message.content for c in whole.choices)
    texts = {0: "", 1: ""}
    usage = None
    for chunk in openai_client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=6, n=2, temperature=1.0, seed=11,
            stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_n_three_seeded_is_one_reproducible_set_of_distinct_choices(openai_client):
    def three():
        return openai_client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=8, n=3, temperature=1.0, seed=5)

    first, again = three(), three()
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and all(texts)
    assert [c.message.content for c in again.choices] == texts
    assert len(set(texts)) > 1  # sample i draws with seed + i
    single = openai_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # counted once


def test_seed_reproduces_a_sampled_output(openai_client):
    def sample(seed: int) -> str:
        return openai_client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0,
            seed=seed).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def _stop_spanning_tokens(openai_client, prompt: str) -> tuple[str, str]:
    """A greedy continuation and a stop string that crosses a token boundary in it."""
    response = openai_client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=0)
    text, tokens = response.choices[0].text, response.choices[0].logprobs.tokens
    for k in range(2, len(tokens) - 1):
        left, right = tokens[k], tokens[k + 1]
        if len(left.strip()) >= 2 and len(right.strip()) >= 2:
            stop = left[-2:] + right[:2]
            if text.find(stop) > 0:
                return text, stop
    pytest.fail(f"no two-token stop string found in {tokens!r}")


def test_stop_string_spanning_tokens_never_leaks(openai_client):
    prompt = "The first five planets of the solar system are"
    text, stop = _stop_spanning_tokens(openai_client, prompt)
    expected = text[: text.index(stop)]
    whole = openai_client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in openai_client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop], stream=True))
    assert streamed == expected
    included = openai_client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
        extra_body={"include_stop_str_in_output": True})
    assert included.choices[0].text == expected + stop


def test_chat_logprobs_in_openai_shape(openai_client):
    response = openai_client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)
    assert content[0].top_logprobs[0].token == content[0].token  # greedy picks the best


def test_repeated_prompt_reports_cached_tokens(openai_client):
    messages = [{"role": "system", "content": "You are a terse assistant who answers in one "
                 "short sentence, never more, and always politely. " * 3},
                {"role": "user", "content": "What is two plus two?"}]
    openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    again = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
