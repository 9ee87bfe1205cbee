"""StopMatcher: holds back only a possible stop prefix, finds stops split across pushes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.detok.stop_matcher import StopHit, StopMatcher


def push_all(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], StopHit | None]:
    outs = []
    for piece in pieces:
        out, hit = matcher.push(piece)
        outs.append(out)
        if hit:
            return outs, hit
    outs.append(matcher.flush())
    return outs, None


def test_no_stops_passes_everything_through():
    assert push_all(StopMatcher([], False), ["ab", "c"]) == (["ab", "c", ""], None)


def test_stop_split_across_pushes_is_not_emitted():
    outs, hit = push_all(StopMatcher(["STOP"], False), ["hello S", "TO", "P world"])
    assert outs == ["hello ", "", ""]
    assert hit == StopHit("STOP", 0)


def test_only_a_possible_prefix_is_held_back():
    matcher = StopMatcher(["abc"], False)
    assert matcher.push("xxab") == ("xx", None)
    assert matcher.push("x") == ("abx", None)


def test_include_stop_str_in_output_emits_up_to_the_stop_end():
    outs, hit = push_all(StopMatcher(["STOP"], True), ["a S", "TOP tail"])
    assert "".join(outs) == "a STOP"
    assert outs == ["a S", "TOP"]
    assert hit == StopHit("STOP", 0)


def test_first_stop_to_complete_wins():
    outs, hit = push_all(StopMatcher(["abcd", "bc"], False), ["abcd"])
    assert (outs, hit) == (["a"], StopHit("bc", 1))


def test_equal_ends_prefer_the_earlier_start():
    outs, hit = push_all(StopMatcher(["c", "bc"], False), ["abc"])
    assert (outs, hit) == (["a"], StopHit("bc", 1))


def test_flush_releases_held_tail_when_no_stop():
    outs, hit = push_all(StopMatcher(["STOP"], False), ["the ST"])
    assert outs == ["the ", "ST"] and hit is None


ALPHABET = st.sampled_from("abAB ")


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.text(ALPHABET, max_size=5), max_size=12),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_property_matches_reference_and_holds_back_minimally(pieces, stops, include):
    matcher = StopMatcher(stops, include)
    pushed, emitted, hit = "", "", None
    for piece in pieces:
        pushed += piece
        out, hit = matcher.push(piece)
        emitted += out
        if hit:
            break
        held = pushed[len(emitted):]
        assert pushed.startswith(emitted)
        assert held == ("" if include else _longest_stop_prefix_suffix(pushed, stops))
    if not hit:
        emitted += matcher.flush()
    assert emitted == _reference(pushed, stops, include)
    if not include:
        assert not any(stop in emitted for stop in stops)


def _longest_stop_prefix_suffix(text: str, stops: list[str]) -> str:
    for length in range(min(len(text), max(map(len, stops)) - 1), 0, -1):
        if any(stop.startswith(text[-length:]) for stop in stops):
            return text[-length:]
    return ""


def _reference(text: str, stops: list[str], include: bool) -> str:
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text
    end, start, _ = min(hits)
    return text[:end] if include else text[:start]
