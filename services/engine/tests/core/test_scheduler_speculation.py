"""Speculative decoding in the scheduler: drafts scheduled with their request, accepted
ones kept, rejected ones' KV slots given back and never cached, the output unchanged.

The fake runner verifies greedily against a fake model and checks every KV slot that
attention would read (conftest.FakeRunner), so a rejected draft counted as computed,
or cached, fails here."""

from __future__ import annotations

import zlib
from array import array

PERIOD = 5


def copying_model(history: list[int], vocab_size: int) -> int:
    """Mostly repeats the token PERIOD back (so n-gram drafts are often right), and
    departs from it where a digest of the history says so (so some are wrong)."""
    digest = zlib.crc32(array("q", history).tobytes())
    if len(history) < PERIOD or digest % 8 == 0:
        return digest % vocab_size
    return history[-PERIOD]


def run(support, num_speculative_tokens: int, requests, **config):
    scheduler = support.make_scheduler(
        num_blocks=config.pop("num_blocks", 40), block_size=4, eos=(3,), max_model_len=80,
        num_speculative_tokens=num_speculative_tokens, **config)
    runner = support.FakeRunner(model=copying_model)
    for request in requests():
        scheduler.add_request(request)
    num_steps = 0
    results: dict[str, list] = {}
    while scheduler.has_unfinished_requests:
        output, updates = support.step(scheduler, runner)
        num_steps += 1
        for update in updates:
            entry = results.setdefault(update.request_id, [[], None])
            entry[0].extend(update.new_token_ids)
            entry[1] = update.finish_reason
        for request in scheduler.running:  # rejected drafts' blocks are back in the pool
            assert len(scheduler.kv.block_table(request)) <= -(-request.num_tokens // 4)
    return results, num_steps, scheduler, runner


def requests_of(support, count: int = 3, max_tokens: int = 40):
    def make():
        return [support.make_request(f"r{i}", [10 + i, 11, 12, 13, 14, 10 + i, 11][: 4 + i],
                                     max_tokens=max_tokens - 7 * i) for i in range(count)]
    return make


def test_drafts_give_the_same_tokens_in_fewer_steps(support):
    plain, plain_steps, _, _ = run(support, 0, requests_of(support))
    spec, spec_steps, scheduler, _ = run(support, 4, requests_of(support))
    assert spec == plain
    assert spec_steps < plain_steps * 0.75, (spec_steps, plain_steps)  # measured 0.6
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_blocks


def test_some_drafts_are_rejected_and_their_requests_carry_the_counts(support):
    scheduler = support.make_scheduler(num_blocks=40, block_size=4, eos=(3,), max_model_len=80,
                                       num_speculative_tokens=4)
    runner = support.FakeRunner(model=copying_model)
    request = support.make_request("r", [10, 11, 12, 13, 14], max_tokens=60)
    scheduler.add_request(request)
    drafted = 0
    while scheduler.has_unfinished_requests:
        output, [update] = support.step(scheduler, runner)
        drafted += len(output.scheduled[0].draft_token_ids)
        assert update.num_draft_tokens == drafted  # the request's totals so far
    assert request.num_draft_tokens == drafted == update.num_draft_tokens
    assert 0 < update.num_accepted_draft_tokens == request.num_accepted_tokens < drafted


def test_same_output_when_blocks_run_short_and_requests_are_preempted(support):
    plain, _, _, _ = run(support, 0, requests_of(support, count=4), num_blocks=20)
    spec, _, scheduler, _ = run(support, 4, requests_of(support, count=4), num_blocks=20,
                                speculative_max_running=8)
    assert spec == plain
    assert scheduler.num_preemptions > 0


def test_a_later_request_reads_only_accepted_tokens_from_the_prefix_cache(support):
    """The runner checks the digest of every cached slot a prefix hit makes it read."""
    results, _, scheduler, runner = run(support, 4, requests_of(support, count=1))
    tokens = results["r0"][0]
    follower = support.make_request("f", [10, 11, 12, 13] + tokens[:-1], max_tokens=4)
    scheduler.add_request(follower)
    output, _ = support.step(scheduler, runner)
    assert output.scheduled[0].num_computed_tokens >= 4 * 8  # read from the cache


def test_no_drafts_past_max_tokens_or_when_many_requests_run(support):
    scheduler = support.make_scheduler(num_blocks=40, block_size=4, max_model_len=80,
                                       num_speculative_tokens=8, speculative_max_running=2)
    runner = support.FakeRunner(model=copying_model)
    short = support.make_request("short", [1, 2, 1, 2, 1, 2], max_tokens=3)
    scheduler.add_request(short)
    while scheduler.has_unfinished_requests:
        output, _ = support.step(scheduler, runner)
        for scheduled in output.scheduled:  # each draft and the token after it are allowed
            num_output = scheduled.num_computed_tokens + 1 - len(scheduled.prompt_token_ids)
            assert len(scheduled.draft_token_ids) < 3 - num_output
    for i in range(3):
        scheduler.add_request(support.make_request(f"m{i}", [1, 2, 1, 2, 1, 2], max_tokens=9))
    while scheduler.has_unfinished_requests:
        output, _ = support.step(scheduler, runner)
        if len(scheduler.running) > 2:
            assert not any(s.draft_token_ids for s in output.scheduled)


def test_drafts_take_only_blocks_nobody_else_needs(support):
    """A's drafts would need the last free block, which B's next token needs: B gets it,
    A decodes without drafts, nobody is preempted."""
    scheduler = support.make_scheduler(num_blocks=4, block_size=4, max_model_len=16,
                                       num_speculative_tokens=4)
    runner = support.ScriptedRunner({"a": [8, 7, 8], "b": [5, 5, 5]})
    scheduler.add_request(support.make_request("a", [7, 8, 7, 8, 7, 8, 7], max_tokens=8))
    scheduler.add_request(support.make_request("b", [1, 2, 3, 4], max_tokens=8))
    support.step(scheduler, runner)  # prefills: a holds 2 blocks, b 1, one is free
    output, _ = support.step(scheduler, runner)
    assert scheduler.num_preemptions == 0
    assert [len(s.token_ids) for s in output.scheduled] == [1, 1]
    assert scheduler.proposer.propose([7, 8] * 4, 4)  # a would have had drafts
