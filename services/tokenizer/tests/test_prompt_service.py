"""PromptService: tokenization off the event loop, id checks, the context-length rule."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.tokenizer.chat_renderer import ChatRenderer
from conveyor.tokenizer.chat_request import ChatRequest
from conveyor.tokenizer.conversation import ChatMessage
from conveyor.tokenizer.errors import ContextLengthExceeded, InvalidRequest
from conveyor.tokenizer.prompt import TextPrompt, TokenIdsPrompt
from conveyor.tokenizer.prompt_service import PromptService
from conveyor.tokenizer.prompt_tokenizer import PromptTokenizer

MAX_MODEL_LEN = 64  # the `service` fixture's context length


async def test_tokenize_text(service, tokenizer):
    prompt = await service.tokenize(TextPrompt("Hello world", max_tokens=5))
    assert prompt.token_ids == tokenizer.encode("Hello world")
    assert (prompt.prompt_text, prompt.num_tokens, prompt.max_model_len) == (
        "Hello world", 2, MAX_MODEL_LEN)


async def test_token_ids_are_taken_as_given(service):
    prompt = await service.tokenize(TokenIdsPrompt([1, 49151, 0]))
    assert prompt.token_ids == [1, 49151, 0] and prompt.prompt_text == ""


async def test_render_tokenizes_the_rendered_text(service, tokenizer):
    request = ChatRequest([ChatMessage("system", "s"), ChatMessage("user", "u")],
                          add_generation_prompt=True)
    prompt = await service.render(request)
    assert prompt.prompt_text.endswith("<|im_start|>assistant\n")
    assert prompt.token_ids == tokenizer.encode(prompt.prompt_text)
    assert prompt.token_ids[0] == 1  # <|im_start|> is one special token, not text


async def test_a_request_is_checked_against_the_max_model_len_it_carries(service):
    """The engines' max_model_len, passed by the gateway, wins over the model's own."""
    ids = [5] * 40
    prompt = await service.tokenize(TokenIdsPrompt(ids, max_tokens=8, max_model_len=48))
    assert prompt.max_model_len == 48
    with pytest.raises(ContextLengthExceeded, match="max_model_len 47;"):
        await service.tokenize(TokenIdsPrompt(ids, max_tokens=8, max_model_len=47))
    chat = ChatRequest([ChatMessage("user", "u")], max_tokens=8, max_model_len=8)
    with pytest.raises(ContextLengthExceeded, match="max_model_len 8;"):
        await service.render(chat)


async def test_context_length_boundary(service):
    ids = [5] * 60
    assert (await service.tokenize(TokenIdsPrompt(ids, max_tokens=4))).num_tokens == 60
    with pytest.raises(ContextLengthExceeded) as caught:
        await service.tokenize(TokenIdsPrompt(ids, max_tokens=5))
    assert (caught.value.prompt_len, caught.value.max_tokens) == (60, 5)
    assert str(caught.value) == (
        "prompt_len 60 + max_tokens 5 = 65 tokens exceeds this model's maximum context length, "
        "max_model_len 64; shorten the prompt or lower max_tokens")


async def test_truncate_prompt_tokens_keeps_the_last_tokens(service, tokenizer):
    """vLLM's truncate_prompt_tokens: the last k tokens (a text's text is theirs), -1 the
    last max_model_len, then the length check on what is kept."""
    text = "one two three four five six"
    kept = await service.tokenize(TextPrompt(text, truncate_prompt_tokens=2))
    assert kept.token_ids == tokenizer.encode(text)[-2:] and kept.prompt_text == " five six"
    assert (await service.tokenize(TextPrompt(text, truncate_prompt_tokens=50))).prompt_text \
        == text  # shorter than k: unchanged
    ids = list(range(100, 200))  # 100 tokens: past the context of 64
    assert (await service.tokenize(TokenIdsPrompt(ids, truncate_prompt_tokens=-1))
            ).token_ids == ids[-MAX_MODEL_LEN:]
    with pytest.raises(ContextLengthExceeded):  # 64 kept + 1 to generate
        await service.tokenize(TokenIdsPrompt(ids, max_tokens=1, truncate_prompt_tokens=-1))
    chat = ChatRequest([ChatMessage("user", "u " * 80)], add_generation_prompt=True,
                       truncate_prompt_tokens=10)
    rendered = await service.render(chat)
    assert rendered.num_tokens == 10 and rendered.prompt_text.endswith("assistant\n")
    for keep, message in ((MAX_MODEL_LEN + 1, "greater than max_model_len 64"),
                          (0, "must be -1 or at least 1"), (-2, "must be -1 or at least 1")):
        with pytest.raises(InvalidRequest, match=message):
            await service.tokenize(TokenIdsPrompt(ids[:3], truncate_prompt_tokens=keep))


async def test_bad_words_come_back_as_vllms_token_sequences(service, tokenizer):
    prompt = await service.tokenize(TextPrompt("Hi", bad_words=("hello", " world peace")))
    hello, spaced = tokenizer.encode("hello"), tokenizer.encode(" hello")
    assert prompt.bad_words[:2] == [hello, spaced] and hello[0] != spaced[0]
    assert tokenizer.encode("world peace") in prompt.bad_words
    assert tokenizer.encode(" world peace") in prompt.bad_words
    for words, message in ((("   ",), "bad_words\\[0\\] must be 1 to 32 tokens"),
                           (("x" * 513,), "longer than 512 characters"),
                           (("w",) * 65, "at most 64 are taken")):
        with pytest.raises(InvalidRequest, match=message):
            await service.tokenize(TextPrompt("Hi", bad_words=words))


@pytest.mark.parametrize("prompt, message", [
    (TextPrompt(""), "prompt is empty; send text or token ids"),
    (TokenIdsPrompt([]), "prompt token_ids is empty; send at least one token id"),
    (TokenIdsPrompt([3, 49152]),
     "prompt token_ids[1] = 49152 is outside the vocabulary (ids must be below 49152)"),
])
async def test_bad_prompts(service, prompt, message):
    with pytest.raises(InvalidRequest) as caught:
        await service.tokenize(prompt)
    assert str(caught.value) == message


async def test_decode_checks_ids(service):
    assert await service.decode([19556, 2], skip_special_tokens=True) == "Hello"
    assert await service.decode([19556, 2], skip_special_tokens=False) == "Hello<|im_end|>"
    with pytest.raises(InvalidRequest, match="is outside the vocabulary"):
        await service.decode([60000], skip_special_tokens=True)


async def test_decode_each_gives_each_id_its_own_text(service):
    assert await service.decode_each([19556, 2], skip_special_tokens=False) == [
        "Hello", "<|im_end|>"]
    with pytest.raises(InvalidRequest, match="is outside the vocabulary"):
        await service.decode_each([2, 60000], skip_special_tokens=False)


async def test_token_strings_are_the_vocabularys_own(service):
    assert await service.token_strings([19556, 905, 2]) == ["Hello", "Ġworld", "<|im_end|>"]
    with pytest.raises(InvalidRequest, match="is outside the vocabulary"):
        await service.token_strings([60000])


async def test_a_long_prompt_does_not_stall_the_event_loop(tokenizer):
    service = PromptService(PromptTokenizer(tokenizer), ChatRenderer(tokenizer), "m", 64,
                            num_workers=2, max_chars_per_token=1_000_000)  # no text limit
    long_prompt = asyncio.create_task(service.tokenize(TextPrompt("lorem ipsum dolor " * 60_000)))
    await asyncio.sleep(0.01)
    short = await service.tokenize(TextPrompt("hi"))
    assert short.num_tokens == 1 and not long_prompt.done()
    with pytest.raises(ContextLengthExceeded):
        await long_prompt
    service.close()


async def test_text_past_the_character_limit_is_refused_before_it_is_tokenized(service):
    for work in (service.tokenize(TextPrompt("x" * (service.max_text_chars + 1))),
                 service.render(ChatRequest([ChatMessage("user", "x" * service.max_text_chars)]))):
        with pytest.raises(InvalidRequest, match="characters, more than the 1024 this service"):
            await work


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=60), max_tokens=st.integers(0, 80))
def test_property_counts_and_length_rule(service, tokenizer, text, max_tokens):
    ids = tokenizer.encode(text)
    try:
        prompt = asyncio.run(service.tokenize(TextPrompt(text, max_tokens=max_tokens)))
    except ContextLengthExceeded:
        assert len(ids) + max_tokens > MAX_MODEL_LEN
        return
    except InvalidRequest:
        assert not ids  # text the vocabulary cannot represent at all
        return
    assert len(ids) + max_tokens <= MAX_MODEL_LEN
    assert prompt.token_ids == ids and prompt.num_tokens == len(ids)


async def test_a_requests_own_chat_template_is_refused_unless_allowed(service, tokenizer):
    request = ChatRequest([ChatMessage("user", "hi")], chat_template="{{ messages[0].content }}")
    with pytest.raises(InvalidRequest, match="ALLOW_REQUEST_CHAT_TEMPLATE=true"):
        await service.render(request)
    allowing = PromptService(PromptTokenizer(tokenizer), ChatRenderer(tokenizer), "m", 64,
                             num_workers=1, allow_request_chat_template=True)
    assert (await allowing.render(request)).prompt_text == "hi"
    allowing.close()
