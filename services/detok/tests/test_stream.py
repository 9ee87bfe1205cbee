"""DetokenizeStream: tokens one at a time through detokenizer and stop matcher."""

from __future__ import annotations

import pytest

from conveyor.detok.decode_options import DecodeOptions
from conveyor.detok.errors import InvalidStreamError
from conveyor.detok.stream import DetokenizeStream, StopMatch, StreamStart


def test_stop_match_names_the_token_that_completed_it(tokenizer):
    ids = tokenizer.encode("one two three four")
    stream = DetokenizeStream(tokenizer, StreamStart(stops=["three"]))
    output = stream.feed(ids)
    assert output.text == "one two "
    assert output.stop_match == StopMatch("three", 0, num_tokens=3)
    assert stream.is_finished


def test_finish_flushes_text_held_for_a_possible_stop(tokenizer):
    stream = DetokenizeStream(tokenizer, StreamStart(stops=["the end"]))
    assert stream.feed(tokenizer.encode("to the")).text == "to "
    final = stream.finish()
    assert (final.text, final.stop_match) == ("the", None)


def test_include_stop_str_in_output(tokenizer):
    start = StreamStart(stops=["\n"], include_stop_str_in_output=True)
    output = DetokenizeStream(tokenizer, start).feed(tokenizer.encode("a\nb"))
    assert output.text == "a\n" and output.stop_match.stop == "\n"


def test_stop_inside_flushed_character_still_matches(tokenizer):
    emoji = tokenizer.encode("😀")
    stream = DetokenizeStream(tokenizer, StreamStart(stops=["\ufffd"]))
    assert stream.feed(emoji[:1]).text == ""
    final = stream.finish()
    assert final.text == "" and final.stop_match.stop == "\ufffd"


@pytest.mark.parametrize("start, ids, message", [
    (StreamStart(stops=["ok", ""]), [], "stop[1] is empty"),
    (StreamStart(prompt_tail_ids=[49152]), [], "prompt_tail_ids[0] = 49152 is outside"),
    (StreamStart(), [5, 70000], "token_ids[1] = 70000 is outside the vocabulary"),
])
def test_bad_input_is_rejected_with_a_clear_message(tokenizer, start, ids, message):
    with pytest.raises(InvalidStreamError, match=message.replace("[", r"\[").replace("]", r"\]")):
        DetokenizeStream(tokenizer, start).feed(ids)


def test_finished_stream_takes_nothing_more(tokenizer):
    stream = DetokenizeStream(tokenizer, StreamStart(options=DecodeOptions()))
    stream.finish()
    with pytest.raises(InvalidStreamError, match="already finished"):
        stream.feed([5])
