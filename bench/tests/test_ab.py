"""The A/B runner's parsing, order and summary, offline's options and the one command line's table
of commands."""

import importlib
import subprocess
import sys

import pytest

from bench import ab
from bench.__main__ import COMMANDS
from bench.arms import run_rounds
from bench.serve import cpu_figures, in_process_ratios


def test_a_variant_is_a_name_settings_and_a_revision():
    assert ab.Variant.parse("new") == ab.Variant("new")
    assert ab.Variant.parse("bf16=CONVEYOR_ENGINE_DTYPE=bfloat16,X=a=b") == ab.Variant(
        "bf16", {"CONVEYOR_ENGINE_DTYPE": "bfloat16", "X": "a=b"})
    assert ab.Variant.parse("old@HEAD~1=K=V") == ab.Variant("old", {"K": "V"}, "HEAD~1")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        ab.Variant.parse("bad=NOVALUE")
    with pytest.raises(ValueError, match="NAME"):
        ab.Variant.parse("@HEAD")


def test_rounds_alternate_without_a_warmup_and_the_summary_holds_medians_ratios_and_spread():
    order = []
    figures = iter([{"x": 10.0}, {"x": 12.0}, {"x": 24.0}, {"x": 10.0}, {"x": 10.0}, {"x": 15.0}])

    def measure(name):
        order.append(name)
        return next(figures)

    runs = run_rounds(["a", "b"], 3, measure, warmup=False).samples
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert runs == {"a": [{"x": 10.0}, {"x": 10.0}, {"x": 10.0}],
                    "b": [{"x": 12.0}, {"x": 24.0}, {"x": 15.0}]}
    rows = ab.summarize(runs)
    b = next(r for r in rows if r["variant"] == "b")
    assert (b["median"], b["ratio"], b["ratio_low"], b["ratio_high"]) == (15.0, 1.5, 1.2, 2.4)
    assert "15 (1.500x, 1.20-2.40)" in ab.markdown(rows)


def test_a_revision_runs_its_own_packages_before_this_trees(tmp_path):
    for folder in ("common/conveyor", "services/engine/conveyor", "services/gateway/conveyor"):
        (tmp_path / folder).mkdir(parents=True)
    env = ab.variant_env(ab.Variant("old", {"K": "V"}, str(tmp_path)))
    path = env["PYTHONPATH"].split(":")
    assert path[:3] == [str(tmp_path / "common"), str(tmp_path / "services/engine"),
                        str(tmp_path / "services/gateway")]
    assert str(ab.REPO_ROOT) in path and env["K"] == "V"


def test_served_figures_per_token_and_against_the_engine_alone():
    out = {"scenarios": {"c1": {"total_output_tokens": 100, "others_cpu_s": 0.1,
                                "cpu_s": {"engine": 2.0, "gateway": 0.1}}}}
    assert cpu_figures(out) == pytest.approx({"c1 CPU ms/token engine": 20.0,
                                              "c1 CPU ms/token gateway": 1.0,
                                              "c1 CPU ms/token others": 1.0})
    assert in_process_ratios({"c1 TPOT p50 ms": 11.0, "c1 tok/s": 5.0},
                             {"c1 TPOT p50 ms": 10.0}) == pytest.approx(
        {"c1 served/in-process TPOT": 1.1})


def test_every_command_has_a_main_and_the_list_names_them():
    for module, _ in COMMANDS.values():
        assert callable(importlib.import_module(module).main), module
    listing = subprocess.run([sys.executable, "-m", "bench"], capture_output=True, text=True,
                             check=True, cwd=ab.REPO_ROOT).stdout
    assert all(name in listing for name in COMMANDS)
    unknown = subprocess.run([sys.executable, "-m", "bench", "nope"], capture_output=True,
                             text=True, cwd=ab.REPO_ROOT)
    assert unknown.returncode == 2


def test_a_revision_checks_out_again_after_its_worktree_folder_was_deleted(tmp_path, monkeypatch):
    monkeypatch.setattr(ab.tempfile, "gettempdir", lambda: str(tmp_path))
    tree = ab.checkout("HEAD")
    try:
        assert (tree / "scripts/gen_protos.py").is_file()
        subprocess.run(["rm", "-rf", str(tree)], check=True)  # as a cleared $TMPDIR leaves it
        assert ab.checkout("HEAD") == tree and (tree / "scripts/gen_protos.py").is_file()
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ab.REPO_ROOT,
                       capture_output=True)


def test_sampling_fields_are_numbers_of_sampling_params_fields():
    from bench.offline import sampling_fields

    assert sampling_fields("temperature=1,top_k=50") == {"temperature": 1.0, "top_k": 50}
    assert sampling_fields("") == {}
    for bad in ("temperature", "topp=0.9", "temperature=x"):
        with pytest.raises(ValueError):
            sampling_fields(bad)


def test_a_profiled_block_prints_its_functions_by_own_time(capsys):
    from bench.offline import _profiled

    def busy_step():
        return sum(i * i for i in range(200_000))

    with _profiled(True, "c1 decode steps"):
        busy_step()
    with _profiled(False, "unprofiled"):
        busy_step()
    out = capsys.readouterr().out
    assert "--- c1 decode steps" in out and "busy_step" in out and "tottime" in out
    assert "unprofiled" not in out
