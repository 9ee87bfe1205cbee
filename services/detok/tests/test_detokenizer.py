"""The Detokenizer with the real SmolLM2 tokenizer: examples of each hard case."""

from __future__ import annotations

import pytest

from conveyor.detok.decode_options import DecodeOptions, decode_full, id_decoder
from conveyor.detok.detokenizer import Detokenizer

IM_START, IM_END = 1, 2
DEFAULT = DecodeOptions()
SMILE_HEAD = 10813  # 'ðŁ': the first two bytes (f0 9f) of many emoji


def deltas(tokenizer, ids, options=DEFAULT, prompt=()) -> list[str]:
    detokenizer = Detokenizer(tokenizer, options, list(prompt))
    return [detokenizer.append(i) for i in ids] + [detokenizer.flush()]


def test_emoji_split_over_three_tokens_appears_whole(tokenizer):
    ids = tokenizer.encode("Hi 😀!")
    out = deltas(tokenizer, ids)
    assert "".join(out) == "Hi 😀!"
    assert "\ufffd" not in "".join(out[:-1])
    assert "😀" in out


def test_cjk_and_combining_marks(tokenizer):
    text = "你好, e\u0301te\u0301 한국어"
    assert "".join(deltas(tokenizer, tokenizer.encode(text))) == text


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer, skip):
    ids = [IM_START, *tokenizer.encode("assistant\nhi"), IM_END]
    text = "".join(deltas(tokenizer, ids, DecodeOptions(skip_special_tokens=skip)))
    assert text == ("assistant\nhi" if skip else "<|im_start|>assistant\nhi<|im_end|>")


def test_spaces_between_special_tokens(tokenizer):
    ids = [IM_START, *tokenizer.encode("a"), IM_END, IM_END, *tokenizer.encode("b")]
    options = DecodeOptions(skip_special_tokens=False, spaces_between_special_tokens=True)
    text = "".join(deltas(tokenizer, ids, options))
    assert text == "<|im_start|> a <|im_end|> <|im_end|> b"
    assert text == decode_full(tokenizer, ids, options)


def test_prompt_tail_gives_context_but_never_text(tokenizer):
    prompt = tokenizer.encode("The prompt says")
    out = tokenizer.encode(" hello")
    assert "".join(deltas(tokenizer, out, prompt=prompt)) == " hello"


def test_prompt_ending_mid_character_does_not_leak_into_output(tokenizer):
    emoji = tokenizer.encode("😀")
    assert emoji[0] == SMILE_HEAD
    prompt = [*tokenizer.encode("look: "), emoji[0]]
    text = "".join(deltas(tokenizer, emoji[1:], prompt=prompt))
    assert text == tokenizer.decode(emoji[1:]) == "\ufffd\ufffd"


def test_output_ending_mid_character_is_flushed_at_finish(tokenizer):
    out = deltas(tokenizer, [*tokenizer.encode("ok"), SMILE_HEAD])
    assert out[-2:] == ["", "\ufffd"]


@pytest.mark.parametrize("skip", [True, False])
def test_id_decoder_is_the_tokenizers_decode(tokenizer, skip):
    decode = id_decoder(tokenizer, skip)
    assert decode.func == tokenizer.backend_tokenizer.decode  # the direct path is taken
    examples = [[IM_START, *tokenizer.encode("Hi 😀 你好"), IM_END], [SMILE_HEAD], [], [0, 17, 300]]
    for ids in examples:
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip)


class _CleaningTokenizer:
    """A tokenizer whose decode post-processes the backend's text."""

    backend_tokenizer = object()
    clean_up_tokenization_spaces = True

    def decode(self, ids, skip_special_tokens=False):
        return f"clean {ids} {skip_special_tokens}"


def test_id_decoder_keeps_a_clean_up_step():
    assert id_decoder(_CleaningTokenizer(), True)([5]) == "clean [5] True"
