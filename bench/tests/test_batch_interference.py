"""bench batch-interference's section: the figures, the target's verdict and the command line."""

from bench.batch_interference import TARGET_RATIO, parse_args, report


def test_the_section_holds_both_ttfts_the_ratio_against_the_target_and_the_command(tmp_path):
    out = tmp_path / "batch_interference.md"
    args = parse_args(["--requests", "3", "--out", str(out)])
    report(args, alone=[0.05, 0.06, 0.07], during=[0.08, 0.09, 0.2], num_lines=30,
           seconds=10.0, status="in_progress")
    text = out.read_text()
    assert text.startswith("## Batch work beside interactive traffic")
    assert "-m bench batch-interference --requests 3 --out" in text
    assert f"| 60 ms | 90 ms | 1.50x | <= {TARGET_RATIO}x (met) | 3.0 |" in text

    report(args, alone=[0.05], during=[0.2], num_lines=5, seconds=1.0, status="completed")
    assert "| 4.00x | <= 1.5x (not met) |" in out.read_text()
