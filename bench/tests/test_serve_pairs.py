"""`bench serve --in-process` runs the served and in-process arms in alternating pairs on the
same prompts and reports the median of the pairs' ratios: a machine whose speed drifts
between pairs moves both arms of a pair alike. `--engine-cpus` gives the engine its own CPUs
in both arms."""

import os
import subprocess
import sys

import pytest

from bench.serve import paired_figures, pin_engine, set_affinity
from bench.serving.client import RequestResult
from bench.serving.metrics import calculate_metrics
from bench.serving.workload import QUICK


class Arm:
    """A target whose TPOT follows a script, one value per measured run; records its runs."""

    def __init__(self, name: str, tpots_ms: list[float], order: list):
        self.name, self.tpots, self.order = name, iter(tpots_ms), order
        self.prompts: list[list] = []

    def run(self, requests, concurrency, num_warmup=1, duration_s=None, ignore_eos=True):
        tpot = 0.01
        if len(requests) > 1 and concurrency == 1:  # a measured c1 run, not a warm-up
            self.order.append(self.name)
            self.prompts.append([r.prompt for r in requests])
            tpot = next(self.tpots) / 1e3
        results = [RequestResult(prompt_len=r.prompt_len, success=True, ttft=0.1,
                                 latency=0.1 + tpot * 9, output_tokens=10) for r in requests]
        return calculate_metrics(results, 1.0), results


def test_pairs_alternate_on_shared_prompts_and_report_the_median_ratio(maker):
    order: list[str] = []
    # The machine slows 3x in the last pair: both arms of that pair see it.
    served = Arm("served", [10.0, 12.0, 30.0], order)
    alone = Arm("alone", [10.0, 10.0, 20.0], order)
    figures = paired_figures(served, alone, maker, QUICK, ("c1",), pairs=3, log=lambda _: None)
    assert order == ["served", "alone", "alone", "served", "served", "alone"]
    assert served.prompts == alone.prompts
    assert len({tuple(map(str, p)) for p in served.prompts}) == 3  # fresh prompts each pair
    assert round(figures["c1 served/in-process TPOT"], 3) == 1.2  # of 1.0, 1.2 and 1.5
    assert round(figures["c1 TPOT p50 ms"], 3) == 12.0


def test_engine_cpus_hold_the_engine_apart_in_both_arms():
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    engine_cpu, other = {min(cpus)}, cpus - {min(cpus)}
    services = {name: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
                for name in ("engine", "gateway")}
    seen = []

    class Alone:
        name = "in-process"

        def run(self, *args, **kwargs):
            seen.append(os.sched_getaffinity(0))

    class Served:
        name = "served"
        pids = {name: p.pid for name, p in services.items()}

    try:
        alone = pin_engine(Served(), Alone(), engine_cpu)
        assert os.sched_getaffinity(services["engine"].pid) == engine_cpu
        assert os.sched_getaffinity(services["gateway"].pid) == other
        assert os.sched_getaffinity(0) == other  # the load generator, beside the services
        alone.run([], 1)
        assert seen == [engine_cpu] and os.sched_getaffinity(0) == other
    finally:
        set_affinity(os.getpid(), cpus)
        for process in services.values():
            process.kill()
            process.wait()
