"""bench/fma_peak.py: the FMA chains count their flops, run on the threads asked for, and give a
rate (the rate itself is the machine's, so only its plausibility is checked)."""

import pytest
import torch

from bench import fma_peak


@pytest.fixture(scope="module")
def kernel():
    from conveyor.engine.native import NativeBuildError

    try:
        return fma_peak._kernel()
    except NativeBuildError as exc:
        pytest.skip(f"no compiler here: {exc}")


@pytest.mark.parametrize("lanes", fma_peak.lanes_available())
def test_flops_are_threads_times_chains_times_lanes(kernel, lanes):
    chains = kernel.chains_per_thread()
    _, flops = kernel.fma_loop(1000, 1, lanes)
    assert flops == 2 * lanes * chains * 1000
    if torch.get_num_threads() >= 2:
        _, flops = kernel.fma_loop(1000, 2, lanes)
        assert flops == 2 * 2 * lanes * chains * 1000


def test_refuses_what_it_cannot_run(kernel):
    with pytest.raises(RuntimeError, match="lanes must be 8 or 16"):
        kernel.fma_loop(10, 1, 4)
    with pytest.raises(RuntimeError, match="threads must be in 1.."):
        kernel.fma_loop(10, torch.get_num_threads() + 1, 8)


def test_a_rate_in_gflops(kernel):
    assert 0.5 < fma_peak.fma_gflops(1, 8, seconds=0.02) < 10_000
