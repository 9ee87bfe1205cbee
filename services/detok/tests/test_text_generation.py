"""TextGeneration and KnownText with the real tokenizer: n samples, each ended on its own;
and a stream resumed after any token, told the text the broken one had sent, going on
with exactly the rest of it: content, stop strings, tool calls."""

from __future__ import annotations

import pytest

from conveyor.detok.errors import InvalidStreamError
from conveyor.detok.stream import StreamStart
from conveyor.detok.text_generation import KnownText, SampleText, TextGeneration
from conveyor.detok.tool_call_formats import ToolCallFormat
from conveyor.detok.tool_call_stream import ToolCallOptions

PROMPT = "<|im_start|>assistant\n"
HELD = StreamStart(stops=["the endgame", ". B"])
"""Holds " the end" (a possible "the endgame") until " is"; ends at ". B"."""
HELD_TEXT = "Hi 😀 the end is near. Bye now"
HERMES_TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
              '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\nDone.')
NAMED = StreamStart(tool_calls=ToolCallOptions(ToolCallFormat.NAMED, "get_weather"))


def _generation(tokenizer, start: StreamStart, resumed_ids: list[int] | None = None,
                known: KnownText | None = None, num_samples: int = 1) -> TextGeneration:
    sample_ids = [f"req-{i}" for i in range(num_samples)] if num_samples > 1 else ["req"]
    return TextGeneration(tokenizer, start, tokenizer.encode(PROMPT), sample_ids, resumed_ids,
                          known)


def _push_each(generation: TextGeneration, ids: list[int]) -> list[SampleText]:
    """Sample 0's text, a token a chunk (the last one finishing it), up to its end."""
    texts = []
    for position, token_id in enumerate(ids):
        text = generation.push(0, [token_id], finished=position == len(ids) - 1)
        if text is None:
            break
        texts.append(text)
    return texts


def _content(texts: list[SampleText]) -> str:
    return "".join(t.text for t in texts)


def _add_calls(calls: dict[int, list[str]], texts: list[SampleText]) -> dict[int, list[str]]:
    """`calls` ({index: [id, name, arguments]}) with the tool-call pieces of `texts`: a
    call's header once, before its arguments."""
    for delta in (d for t in texts for d in t.tool_calls):
        if delta.id:
            assert delta.index == len(calls) and delta.name, delta
            calls[delta.index] = [delta.id, delta.name, ""]
        else:
            assert delta.index in calls and not delta.name, delta
        calls[delta.index][2] += delta.arguments
    return calls


def test_the_held_case_covers_a_split_character_and_a_held_stop_prefix(tokenizer):
    ids = tokenizer.encode(HELD_TEXT)
    texts = _push_each(_generation(tokenizer, HELD), ids)
    so_far = [_content(texts[:k]) for k in range(len(texts) + 1)]
    assert tokenizer.decode(ids[:2]).endswith("\ufffd") and so_far[2] == "Hi "
    assert tokenizer.decode(ids[:5]).endswith("the end") and so_far[5] == "Hi 😀 "
    assert _content(texts) == "Hi 😀 the end is near" and texts[-1].stop == ". B"


@pytest.mark.parametrize("start, text", [
    (HELD, HELD_TEXT),
    (StreamStart(stops=["."], include_stop_str_in_output=True), "你好 (and 😀 too). Then"),
    (StreamStart(), "no stop: 日本語 text to the end"),
])
@pytest.mark.parametrize("rest_in_one_chunk", [False, True])
def test_a_stream_resumed_after_any_token_goes_on_with_exactly_the_rest(
        tokenizer, start, text, rest_in_one_chunk):
    ids = tokenizer.encode(text)
    whole = _push_each(_generation(tokenizer, start), ids)
    if whole[-1].stop is None:
        assert _content(whole) == tokenizer.decode(ids)
    for k in range(1, len(whole)):
        so_far = _content(whole[:k])
        resumed = _generation(tokenizer, start, ids[:k], KnownText(len(so_far)))
        if rest_in_one_chunk:
            rest = [resumed.push(0, ids[k:], finished=True)]
        else:
            rest = _push_each(resumed, ids[k:])
        assert so_far + _content(rest) == _content(whole), k
        assert sum(t.num_tokens for t in rest) == sum(t.num_tokens for t in whole[k:]), k
        assert (rest[-1].stop, rest[-1].num_output_tokens) == (whole[-1].stop,
                                                                whole[-1].num_output_tokens)
        assert resumed.is_finished


@pytest.mark.parametrize("start, text", [  # Hermes sends a call whole once its block
    # closes (k falls before, between and after the calls); NAMED sends the arguments as
    # they come (k falls inside them)
    (StreamStart(tool_calls=ToolCallOptions(ToolCallFormat.HERMES)), HERMES_TWO),
    (NAMED, '{"city": "Paris", "unit": "celsius"}'),
])
def test_a_resumed_stream_sends_each_calls_header_once_and_exact_arguments(tokenizer, start,
                                                                           text):
    ids = tokenizer.encode(text)
    whole = _push_each(_generation(tokenizer, start), ids)
    calls = _add_calls({}, whole)
    assert len(calls) == (2 if start is not NAMED else 1)
    for k in range(1, len(whole)):
        content, calls_so_far = _content(whole[:k]), _add_calls({}, whole[:k])
        known = KnownText(len(content), [len(c[2]) for _, c in sorted(calls_so_far.items())])
        rest = _push_each(_generation(tokenizer, start, ids[:k], known), ids[k:])
        assert content + _content(rest) == _content(whole), k
        assert _add_calls(calls_so_far, rest) == calls, k


def test_samples_end_on_their_own(tokenizer):
    generation = _generation(tokenizer, StreamStart(stops=[". "]), num_samples=2)
    first = generation.push(0, tokenizer.encode("Yes. It is"), finished=False)
    assert (first.text, first.stop, first.num_tokens) == ("Yes", ". ", 3)
    assert not generation.is_finished
    assert generation.push(0, tokenizer.encode(" more"), finished=False) is None
    second = generation.push(1, tokenizer.encode("No way"), finished=True)
    assert (second.text, second.stop, second.num_tokens) == ("No way", None, 2)
    assert generation.is_finished


def test_a_sample_past_n_is_the_engines_error(tokenizer):
    generation = _generation(tokenizer, StreamStart(), num_samples=2)
    with pytest.raises(InvalidStreamError, match="the engine sent sample 2 of 2"):
        generation.push(2, [5], finished=False)


def test_known_text_is_only_for_one_resumed_sample(tokenizer):
    with pytest.raises(InvalidStreamError, match="text_so_far is only for a resumed"):
        _generation(tokenizer, StreamStart(), known=KnownText(3))
    with pytest.raises(InvalidStreamError, match="a resumed generation has one sample"):
        _generation(tokenizer, StreamStart(), [5], num_samples=2)
