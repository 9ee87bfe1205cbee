"""bench/pipeline_cpu.py's accounting: CPU and wake-ups per token, rounds, ratios."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import pipeline_cpu
from bench.pipeline_cpu import (
    Repo,
    format_in_process,
    format_ratios,
    ms_per_token,
    parse_switches,
    repo_pythonpath,
    round_order,
    summarize,
    wakeups,
    with_others,
)

STATUS = """Name:\tpython
State:\tS (sleeping)
voluntary_ctxt_switches:\t1234
nonvoluntary_ctxt_switches:\t56
"""


def test_parse_switches_reads_the_voluntary_count():
    assert parse_switches(STATUS) == 1234
    assert parse_switches("Name:\tx\n") == 0


def test_wakeups_add_up_every_thread(tmp_path):
    for tid, count in ((10, 5), (11, 7)):
        task = tmp_path / "10" / "task" / str(tid)
        task.mkdir(parents=True)
        (task / "status").write_text(STATUS.replace("1234", str(count)))
    assert wakeups(10, proc=tmp_path) == 12
    assert wakeups(99, proc=tmp_path) == 0  # gone


def test_ms_per_token_and_the_others():
    cpu = with_others({"engine": 3.0, "gateway": 0.5}, machine_busy_s=4.0)
    assert cpu["others"] == pytest.approx(0.5)
    assert ms_per_token(cpu, 1000) == pytest.approx({"engine": 3.0, "gateway": 0.5,
                                                     "others": 0.5})
    assert ms_per_token(cpu, 0)["engine"] == 0.0
    assert with_others({"engine": 3.0}, machine_busy_s=2.9)["others"] == 0.0  # read apart


def _row(repo: str, concurrency: int, gateway_ms: float, tpot_ms: float,
         others_s: float = 0.0) -> dict:
    return {"repo": repo, "concurrency": concurrency, "duration_s": 10.0,
            "cpu_s": {"gateway": gateway_ms, "others": others_s},
            "cpu_ms_per_token": {"gateway": gateway_ms, "others": others_s},
            "wakeups_per_token": {"gateway": 10.0}, "tpot_p50_ms": tpot_ms,
            "output_tok_s": 100.0}


def test_summary_means_rounds_and_leaves_out_disturbed_ones():
    rows = [_row("old", 1, 1.0, 10.0), _row("new", 1, 0.5, 9.0),
            _row("old", 1, 3.0, 30.0, others_s=5.0),  # 0.5 cores of others: disturbed
            _row("new", 1, 0.7, 9.4), _row("old", 1, 1.2, 10.4)]
    summary = summarize(rows)
    old, new = summary
    assert (old["repo"], old["rounds"]) == ("old", 2)
    assert old["cpu_ms_per_token"]["gateway"] == pytest.approx(1.1)
    assert new["tpot_p50_ms"] == pytest.approx(9.2)
    ratio, = format_ratios(summary)
    assert ratio.startswith("new/old c1: TPOT p50 0.902x")
    assert "gateway 0.55x" in ratio


def test_served_c1_over_each_repos_own_in_process_tpot():
    summary = summarize([_row("old", 1, 1.0, 12.0), _row("new", 1, 0.5, 11.0),
                         _row("new", 16, 0.5, 30.0)])
    in_process = [{"repo": "old", "tpot_p50_ms": 10.0}, {"repo": "new", "tpot_p50_ms": 9.0},
                  {"repo": "new", "tpot_p50_ms": 11.0}]
    old, new = format_in_process(summary, in_process)
    assert old.startswith("old c1: served 12.00 ms / in-process 10.00 ms = 1.200x")
    assert new.startswith("new c1: served 11.00 ms / in-process 10.00 ms = 1.100x")
    assert format_in_process(summary, []) == []


def test_a_group_of_disturbed_rounds_only_is_still_reported():
    summary = summarize([_row("old", 16, 2.0, 50.0, others_s=9.0)])
    assert summary[0]["rounds"] == 1


def test_repo_spec_and_its_pythonpath(tmp_path):
    for folder in ("common", "services/gateway", "services/detok"):
        (tmp_path / folder / "conveyor").mkdir(parents=True)
    (tmp_path / "services" / "docs").mkdir()  # not a package folder
    repo = Repo.parse(f"old={tmp_path}")
    assert repo.name == "old"
    assert repo_pythonpath(repo.path).split(":") == [
        str(tmp_path / "common"), str(tmp_path / "services" / "detok"),
        str(tmp_path / "services" / "gateway")]
    with pytest.raises(argparse.ArgumentTypeError):
        Repo.parse(str(tmp_path))


def test_arguments():
    args = pipeline_cpu.parse_args(["--repo", "a=/tmp", "--concurrency", "1,16",
                                    "--engine-env", "CONVEYOR_ENGINE_WEIGHT_FORMAT=q4_1_int8",
                                    "--engine-env", "a:GRPC_EXPERIMENTS=-x,-y",
                                    "--service-env", "a=GRPC_EXPERIMENTS=-x,-y"])
    assert args.concurrency == [1, 16]
    assert args.engine_env == [("", "CONVEYOR_ENGINE_WEIGHT_FORMAT", "q4_1_int8"),
                               ("a", "GRPC_EXPERIMENTS", "-x,-y")]
    assert args.service_env == [["a", "GRPC_EXPERIMENTS", "-x,-y"]]


def test_rounds_alternate_which_repo_goes_first():
    a, b = Repo("a", Path("/a")), Repo("b", Path("/b"))
    assert [[r.name for r in round_order([a, b], i)] for i in range(3)] == [
        ["a", "b"], ["b", "a"], ["a", "b"]]
