"""Runs a step on the model runner and pins a failure on the requests that cause it."""

from __future__ import annotations

import logging
from typing import Protocol

from conveyor.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger("conveyor.engine.core")


class ModelRunnerLike(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class IsolatingRunner:
    """When a batch fails, runs its requests again one by one so only the guilty fail:
    each failure becomes an entry of the output's `failures`.

    Rerunning is safe: a request's KV writes go to its own slots and are the same
    values again, and attention reads only the request's own blocks.
    """

    def __init__(self, runner: ModelRunnerLike):
        self.runner = runner

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The runner's output for the step (an empty one for an empty step)."""
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        try:
            return self.runner.execute(scheduler_output)
        except Exception as exc:
            if len(scheduler_output.scheduled) == 1:
                log.exception("model step failed")
                return ModelRunnerOutput(
                    failures={scheduler_output.scheduled[0].request_id: _message(exc)})
            log.warning("model step of %d requests failed (%s); retrying them one by one",
                        len(scheduler_output.scheduled), exc)
            return self._execute_one_by_one(scheduler_output)

    def _execute_one_by_one(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        for i, scheduled in enumerate(scheduler_output.scheduled):
            first = i == 0  # the bookkeeping lists go with the first retry only
            single = SchedulerOutput(
                scheduled=[scheduled],
                preempted_request_ids=scheduler_output.preempted_request_ids if first else [],
                block_size=scheduler_output.block_size,
                finished_request_ids=scheduler_output.finished_request_ids if first else [],
            )
            try:
                output = self.runner.execute(single)
                result.sampled.update(output.sampled)
                result.prompt_logprobs.update(output.prompt_logprobs)
            except Exception as exc:
                log.exception("model failed request %s", scheduled.request_id)
                result.failures[scheduled.request_id] = _message(exc)
        return result


def _message(exc: Exception) -> str:
    return f"model error: {type(exc).__name__}: {exc}"
