"""IncrementalDecoder over a toy byte-level vocabulary: each token is some bytes."""

from __future__ import annotations

from conveyor.detok.incremental_decoder import IncrementalDecoder

SMILE = "😀".encode()  # f0 9f 98 80
VOCAB = {0: b"a", 1: b" b", 2: SMILE[:2], 3: SMILE[2:], 4: b"\x80", 5: "你".encode()}


def toy_decode(ids: list[int]) -> str:
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


class CountingDecode:
    def __init__(self):
        self.lengths: list[int] = []

    def __call__(self, ids: list[int]) -> str:
        self.lengths.append(len(ids))
        return toy_decode(ids)


def run(ids: list[int], context: list[int] = ()) -> list[str]:
    decoder = IncrementalDecoder(toy_decode, list(context))
    return [decoder.append(i) for i in ids] + [decoder.flush()]


def test_plain_tokens_come_out_one_by_one():
    assert run([0, 1, 1]) == ["a", " b", " b", ""]


def test_split_character_is_held_until_complete():
    assert run([0, 2, 3, 0]) == ["a", "", "😀", "a", ""]


def test_text_before_a_held_character_is_not_delayed():
    assert run([2, 0, 2]) == ["", "\ufffda", "", "\ufffd"]


def test_flush_releases_an_incomplete_character():
    assert run([0, 2]) == ["a", "", "\ufffd"]


def test_context_text_is_never_emitted():
    assert run([1], context=[5, 0]) == [" b", ""]


def test_window_stays_short_on_long_output():
    decode = CountingDecode()
    decoder = IncrementalDecoder(decode, [])
    text = "".join(decoder.append(i) for i in [0, 1, 5] * 200)
    assert text == toy_decode([0, 1, 5] * 200)
    assert max(decode.lengths) <= 2
