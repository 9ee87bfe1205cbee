from __future__ import annotations

import pytest

from conveyor.engine.spec.ngram_proposer import NgramProposer


def test_proposes_what_followed_the_longest_recurring_suffix():
    proposer = NgramProposer(2, 4)
    # "7 8 9" recurs (after 1 and after 5); the longer match, "5 7 8 9", decides.
    tokens = [1, 7, 8, 9, 20, 21, 5, 7, 8, 9, 30, 31, 32, 5, 7, 8, 9]
    assert proposer.propose(tokens, 3) == [30, 31, 32]
    assert proposer.propose(tokens, 1) == [30]


def test_latest_occurrence_of_an_equally_long_match_wins():
    tokens = [4, 5, 1, 1, 4, 5, 2, 2, 4, 5]
    assert NgramProposer(2, 4).propose(tokens, 2) == [2, 2]


def test_shorter_than_min_n_or_no_recurrence_proposes_nothing():
    proposer = NgramProposer(2, 3)
    assert proposer.propose([1, 2, 3, 4, 1], 4) == []  # only a 1-gram recurs
    assert proposer.propose([1, 2, 3], 4) == []
    assert proposer.propose([1, 2, 1, 2], 0) == []
    assert NgramProposer(1, 3).propose([1, 2, 3, 4, 1], 4) == [2, 3, 4, 1]


def test_proposal_stops_at_the_end_of_the_tokens():
    assert NgramProposer(2, 2).propose([6, 7, 6, 7], 5) == [6, 7]


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="ngram"):
        NgramProposer(3, 2)
