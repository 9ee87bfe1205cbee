"""Test support for the engine core: a fake model runner and an invariant checker.

Pytest runs with --import-mode=importlib, where test modules cannot import a
sibling helper module, so the helpers live here and reach tests through the
`support` fixture.
"""

from __future__ import annotations

import zlib
from array import array
from types import SimpleNamespace

import pytest

from conveyor.engine.core.config import EngineConfig
from conveyor.engine.core.request import Request
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.core.scheduler_output import (
    ModelRunnerOutput,
    SampledToken,
    ScheduledRequest,
    SchedulerOutput,
)
from conveyor.engine.request_delta import RequestDelta
from conveyor.engine.sampling_params import SamplingParams


def next_token(history: list[int], vocab_size: int) -> int:
    """The fake model: a token that depends on the whole history and nothing else."""
    return zlib.crc32(array("q", history).tobytes()) % vocab_size


class FakeRunner:
    """Plays the model runner: checks the batch and the KV slots as attention would read them.

    It keeps a shadow KV cache, slot -> a digest of the tokens 0..p at the position p
    written there. Before "computing" a request's new tokens it checks that every
    earlier position's slot still holds that request's digest (so a wrong prefix
    hit, a wrong slot mapping or a block reused while still in use fails here),
    then writes the new positions. The sampled token is `next_token(history)`.
    """

    def __init__(self, vocab_size: int = 64, model=next_token) -> None:
        self.vocab_size = vocab_size
        self.model = model
        """The next token of a history: (history, vocab_size) -> token."""
        self.kv: dict[int, int] = {}
        self.num_steps = 0

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        sampled: dict[str, list[SampledToken]] = {}
        for scheduled in output.scheduled:
            drafts = scheduled.draft_token_ids
            history = scheduled.prompt_token_ids + scheduled.output_token_ids + drafts
            self._compute(scheduled, history, output.block_size)
            if scheduled.needs_sample:
                sampled[scheduled.request_id] = self._verify(history, scheduled.seq_len, drafts)
        return ModelRunnerOutput(sampled)

    def _verify(self, history: list[int], seq_len: int, drafts: list[int]) -> list[SampledToken]:
        """Greedy verification: the next token after the known tokens, then after each draft
        while the drafts are what comes next."""
        known = seq_len - len(drafts)
        tokens = []
        for j in range(len(drafts) + 1):
            tokens.append(SampledToken(self.model(history[:known + j], self.vocab_size),
                                       logprob=-0.5))
            if j == len(drafts) or tokens[-1].token_id != drafts[j]:
                break
        return tokens

    def _compute(self, scheduled: ScheduledRequest, history: list[int], block_size: int) -> None:
        start, end = scheduled.num_computed_tokens, scheduled.seq_len
        assert scheduled.token_ids == history[start:end]
        assert len(scheduled.slot_mapping) == end - start
        table = scheduled.block_table
        digest = 0
        for position in range(end):
            digest = zlib.crc32(array("q", [history[position]]).tobytes(), digest)
            slot = table[position // block_size] * block_size + position % block_size
            if position < start:
                assert self.kv.get(slot) == digest, (scheduled.request_id, position)
            else:
                assert scheduled.slot_mapping[position - start] == slot
                self.kv[slot] = digest


class ScriptedRunner:
    """A model runner that answers each request from a fixed script of tokens (then 0s)."""

    def __init__(self, scripts: dict[str, list[int]]) -> None:
        self.scripts = {request_id: list(tokens) for request_id, tokens in scripts.items()}

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        sampled = {}
        for scheduled in output.scheduled:
            if scheduled.needs_sample:
                script = self.scripts.get(scheduled.request_id, [])
                sampled[scheduled.request_id] = [SampledToken(script.pop(0) if script else 0)]
        return ModelRunnerOutput(sampled)


def make_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int = 16,
    priority: int = 0,
    cache_salt: str | None = None,
    **params,
) -> Request:
    return Request(
        request_id,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, **params),
        priority=priority,
        cache_salt=cache_salt,
    )


def make_scheduler(num_blocks: int = 10, block_size: int = 4, eos: tuple[int, ...] = (), **kw):
    kw.setdefault("max_model_len", min(num_blocks * block_size, 64))
    config = EngineConfig(num_blocks=num_blocks, block_size=block_size, **kw)
    return Scheduler(config, eos_token_ids=eos)


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[RequestDelta]]:
    """One engine-loop iteration, checking invariants before and after."""
    output = scheduler.schedule()
    check_invariants(scheduler)
    updates = scheduler.update_from_output(output, runner.execute(output))
    check_invariants(scheduler)
    return output, updates


def run_until_done(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> dict:
    """Step until no request is left; returns each request's tokens and finish reason."""
    results: dict[str, list] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests:
            return results
        _, updates = step(scheduler, runner)
        for update in updates:
            entry = results.setdefault(update.request_id, [[], None])
            entry[0].extend(update.new_token_ids)
            entry[1] = update.finish_reason
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def check_invariants(scheduler: Scheduler) -> None:
    """Ref counts match the block tables; free and used blocks partition the pool; the
    hash map and the blocks agree; running and waiting partition the live requests."""
    kv, pool = scheduler.kv, scheduler.kv.pool
    holders = [*scheduler.running, *scheduler._aborted_in_flight]
    expected = [0] * pool.num_blocks
    for request in holders:
        table = kv.block_table(request)
        assert len(table) * kv.block_size >= request.num_computed_tokens
        for block_id in table:
            expected[block_id] += 1
    assert all(r.block_ids is None for r in scheduler.waiting)  # only holders hold blocks
    assert [block.ref_cnt for block in pool.blocks] == expected
    free_ids = set(pool.free_queue.block_ids())
    assert len(free_ids) == pool.num_free_blocks
    assert free_ids == {block.block_id for block in pool.blocks if block.ref_cnt == 0}
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    for block_hash, block in pool.cached_blocks.items():
        assert block.block_hash == block_hash and block.key is not None
    assert sum(block.is_cached for block in pool.blocks) == len(pool.cached_blocks)
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    live = {id(r) for r in scheduler.running} | {id(r) for r in scheduler.waiting}
    assert len(live) == len(scheduler.running) + len(scheduler.waiting)
    assert live == {id(r) for r in scheduler.requests.values()}
    assert scheduler.waiting.num_tokens == sum(r.num_tokens_to_compute for r in scheduler.waiting)


@pytest.fixture
def support() -> SimpleNamespace:
    return SimpleNamespace(
        FakeRunner=FakeRunner,
        ScriptedRunner=ScriptedRunner,
        next_token=next_token,
        make_request=make_request,
        make_scheduler=make_scheduler,
        step=step,
        run_until_done=run_until_done,
        check_invariants=check_invariants,
    )
