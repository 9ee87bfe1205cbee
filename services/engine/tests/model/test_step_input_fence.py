"""Host-device discipline of the step inputs: pinned host buffers are not rewritten while
a non-blocking copy from them may be pending, and a step waits for the device once.

On CUDA the copy fence is an event; here a fake stands in for it: a copy stays pending
from `record` until the fence is waited on (or marked complete by a synchronising read),
and the fake notes what the host buffer held when it was waited on.
"""

from __future__ import annotations

from conveyor.engine.core.scheduler_output import SchedulerOutput
from conveyor.engine.worker.step_inputs import StepInputBuilder


class PendingCopies:
    """A CopyFence whose copies run only when waited for."""

    def __init__(self) -> None:
        self.pending = False
        self.blocking_waits = 0
        self.host_ids_at_wait: list[list[int]] = []
        self.builder: StepInputBuilder | None = None

    def record(self) -> None:
        self.pending = True

    def wait(self) -> None:
        if self.pending:
            self.blocking_waits += 1
            self.host_ids_at_wait.append(self.builder._input_ids.np[:3].tolist())
            self.pending = False

    def mark_complete(self) -> None:
        self.pending = False


def fenced(runner) -> PendingCopies:
    fence = PendingCopies()
    fence.builder = runner.inputs
    runner.inputs.fence = fence
    return fence


def test_build_waits_for_pending_copies_before_rewriting_the_host_buffers(tiny_runner,
                                                                           make_driver):
    runner = tiny_runner()
    fence = fenced(runner)
    driver = make_driver(runner, token_budget=64)
    driver.add("a", [5, 6, 7], 2)
    first = driver.schedule()
    runner.inputs.build(first)
    assert fence.pending
    runner.inputs.build(SchedulerOutput(scheduled=[first.scheduled[0]], block_size=16))
    assert fence.host_ids_at_wait == [[5, 6, 7]]  # the first step's ids, still intact


def test_a_step_without_samples_waits_for_its_copies_once(tiny_runner, make_driver):
    runner = tiny_runner()
    fence = fenced(runner)
    driver = make_driver(runner, token_budget=4)
    driver.add("long", list(range(3, 13)), 1)  # 10 tokens: chunks of 4, 4, then 2
    assert runner.execute(driver.schedule()).sampled == {}
    assert not fence.pending and fence.blocking_waits == 1


def test_a_sampling_step_does_not_wait_again(tiny_runner, make_driver):
    runner = tiny_runner()
    fence = fenced(runner)
    driver = make_driver(runner, token_budget=64)
    driver.add("a", [5, 6, 7], 3)
    driver.step()
    driver.step()
    assert driver.requests[0].output and not fence.pending
    assert fence.blocking_waits == 0  # reading the sampled tokens synchronised
