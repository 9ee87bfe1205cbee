"""bench/arms.py without a model: rounds rotate the arms and drop the warm-up round; medians,
per-round ratios, totals; the section's opening and table."""

from __future__ import annotations

import itertools

from bench import arms


def test_each_round_starts_one_arm_later():
    assert [arms.rotated("abc", i) for i in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_rounds_run_in_rotating_order_and_the_warm_up_round_is_not_kept():
    runs, clock = [], itertools.count()

    def measure(arm):
        runs.append(arm)
        return {"t": next(clock)}

    rounds = arms.run_rounds(("a", "b", "c"), 2, measure)
    assert runs == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert rounds.samples == {"a": [{"t": 5}, {"t": 7}], "b": [{"t": 3}, {"t": 8}],
                              "c": [{"t": 4}, {"t": 6}]}


def test_the_rounds_are_written_to_stderr_and_stdout_stays_for_the_figures(capsys):
    arms.run_rounds(("a", "b"), 1, lambda arm: {"t": 1.5})
    out, err = capsys.readouterr()
    assert out == "" and "round 1 a: t 1.5" in err and "round 1 b: t 1.5" in err


def test_medians_ratios_per_round_and_totals():
    rounds = arms.Rounds({"base": [{"x": 10}, {"x": 20}, {"x": 40}],
                          "new": [{"x": 5}, {"x": 30}, {"x": 20}]})
    assert rounds.median("new", "x") == 20
    assert rounds.ratio("new", "base", "x") == 0.5  # of 0.5, 1.5, 0.5: not 20 / 20
    assert rounds.total("new", "x") == 55
    assert rounds.summary("base", "x") == {"base": {"x": 20, "x_ratio": 1.0},
                                           "new": {"x": 20, "x_ratio": 0.5}}


def test_a_section_opens_with_how_it_ran_then_the_table():
    figures = {"command": "python -m bench x --rounds 3", "date": "2026-01-02 03:04 UTC",
               "dtype": "bfloat16", "torch_threads": 2, "cpu": "avx2 amx", "num_cpus": 8,
               "load_average": [0.5, 1.5], "rounds": 3}
    text = arms.section("## X", figures, "c4", ["arm", "tok/s"], [["a", 1.5], ["b", ""]], "Note.")
    heading, _, opening, _, *table, _, note, end = text.split("\n")
    assert heading == "## X" and note == "Note." and end == ""
    assert opening.startswith("`python -m bench x --rounds 3` on 2026-01-02 03:04 UTC")
    assert "bfloat16" in opening and "avx2 amx" in opening and "0.5 -> 1.5" in opening
    assert opening.endswith("; c4.")
    assert table == ["| arm | tok/s |", "|---|---|", "| a | 1.5 |", "| b |  |"]
