"""The soak traffic's pure helpers: traffic mix, stop expectations, token checks."""

from itertools import islice

from bench.soak_traffic import (
    KINDS,
    StreamRecord,
    expected_before_stop,
    pick_kinds,
    stop_for,
    token_problems,
)


def test_the_traffic_mix_is_reproducible_and_uses_every_kind():
    first = list(islice(pick_kinds(7), 300))
    assert first == list(islice(pick_kinds(7), 300))
    assert set(first) == set(KINDS)
    assert first.count("stream") > first.count("bad")


def test_a_stop_string_cuts_the_reference_before_its_first_match():
    reference = "Red, green and blue are colours."
    stop = stop_for(reference)
    assert stop == "and"
    assert expected_before_stop(reference, stop) == "Red, green "
    assert stop_for("Too short") is None


def test_token_problems_catch_lost_duplicated_and_miscounted_tokens():
    good = {0: StreamRecord("abc", 3, "length"), 1: StreamRecord("abc", 3, "length")}
    assert token_problems(good, {"completion_tokens": 6}, "abc", 3) == []
    lost = {0: StreamRecord("ab", 2, "length")}
    assert len(token_problems(lost, {"completion_tokens": 2}, "abc", 3)) == 3
    duplicated = {0: StreamRecord("abcc", 3, "length")}
    assert token_problems(duplicated, {"completion_tokens": 3}, "abc", 3) == [
        "choice 0: text differs from the reference"]
    assert token_problems({0: StreamRecord("abc", 3)}, None, "abc", 3)
