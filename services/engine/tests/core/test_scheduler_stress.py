"""Seeded random add / abort / finish events on a small pool, checking invariants every step.

The fake runner checks every KV slot a request reads (so a wrong prefix hit or a
block reused while in use fails at once), and since its tokens depend only on the
history, each request that finishes must produce exactly what it would alone.
"""

from __future__ import annotations

import random

import pytest

from conveyor.engine.core.request import FinishReason, Request
from conveyor.engine.core.stop_check import check_finished

VOCAB = 16
EOS = (0,)
PREFIXES = [[3, 4, 5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 11, 12], [13, 14, 15, 13, 14, 15, 13]]


def solo_output(support, request: Request, max_model_len: int) -> tuple[list[int], FinishReason]:
    """What the fake model produces for this request run on its own."""
    alone = Request("solo", request.prompt_token_ids, request.sampling_params)
    while True:
        alone.output_token_ids.append(support.next_token(alone.all_token_ids, VOCAB))
        reason = check_finished(alone, frozenset(EOS), max_model_len)
        if reason is not None:
            return alone.output_token_ids, reason


def random_request(support, rng: random.Random, index: int, max_model_len: int) -> Request:
    prompt = list(rng.choice(PREFIXES))[: rng.randint(1, 8)]
    prompt += [rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 10))]
    max_tokens = rng.randint(1, min(10, max_model_len - len(prompt)))
    return support.make_request(
        f"r{index}",
        prompt,
        max_tokens=max_tokens,
        priority=rng.choice([0, 0, 1, 2]),
        cache_salt=rng.choice([None, None, "tenant"]),
        ignore_eos=rng.random() < 0.3,
        min_tokens=rng.randint(0, max_tokens) if rng.random() < 0.2 else 0,
    )


CONFIGS = [
    dict(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=16),
    dict(num_blocks=9, block_size=4, max_num_seqs=8, max_num_batched_tokens=12,
         long_prefill_token_threshold=5),
    dict(num_blocks=20, block_size=2, max_num_seqs=3, max_num_batched_tokens=7),
    dict(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
         enable_prefix_caching=False),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("config", CONFIGS, ids=["base", "threshold", "block2", "nocache"])
def test_random_events_keep_the_invariants(support, config, seed):
    rng = random.Random(seed)
    max_model_len = 32
    sched = support.make_scheduler(eos=EOS, max_model_len=max_model_len, **config)
    runner = support.FakeRunner(vocab_size=VOCAB)
    added: dict[str, Request] = {}
    finished: dict[str, tuple[list[int], FinishReason]] = {}
    num_events = 0

    def record(updates) -> None:
        for update in updates:
            if update.finished:
                request = added[update.request_id]
                finished[update.request_id] = (request.output_token_ids, update.finish_reason)

    for _ in range(1500):
        for _ in range(rng.choice([0, 0, 1, 1, 2])):
            request = random_request(support, rng, len(added), max_model_len)
            added[request.request_id] = request
            sched.add_request(request)
            num_events += 1
        if added and rng.random() < 0.15:  # abort anything: waiting, running, done, twice
            sched.abort(rng.choice(list(added)))
            num_events += 1
        output = sched.schedule()
        support.check_invariants(sched)
        if output.scheduled and rng.random() < 0.1:  # abort while the step is in flight
            sched.abort(rng.choice(output.scheduled).request_id)
            support.check_invariants(sched)
            num_events += 1
        record(sched.update_from_output(output, runner.execute(output)))
        support.check_invariants(sched)

    for _ in range(5000):  # drain
        if not sched.has_unfinished_requests:
            break
        _, updates = support.step(sched, runner)
        record(updates)
    num_events += len(finished)

    assert not sched.has_unfinished_requests
    assert sched.kv.num_free_blocks == config["num_blocks"]
    assert all(block.ref_cnt == 0 for block in sched.kv.pool.blocks)
    assert all(request.block_ids is None for request in added.values())
    assert num_events > 2000
    for request_id, (tokens, reason) in finished.items():
        assert (tokens, reason) == solo_output(support, added[request_id], max_model_len)
    assert sched.num_preemptions > 0
    if config.get("enable_prefix_caching", True):
        assert sched.kv.num_prefix_hit_tokens > 0
