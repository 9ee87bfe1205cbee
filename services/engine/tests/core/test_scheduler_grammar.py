"""The scheduler passes over a request still waiting for its grammar (vLLM's WAITING_FOR_FSM):
requests behind it run meanwhile, and it is admitted once its grammar has started."""

from __future__ import annotations

import math
from concurrent.futures import Future

from conveyor.engine import StructuredOutputsParams
from conveyor.engine.structured.request_grammar import RequestGrammar

TOKENS = [f"{i:02d}".encode() for i in range(63)] + [b""]
"""The fake runner's 64-token vocabulary: two digits each, EOS last."""


def test_a_request_waiting_for_its_grammar_is_passed_over(support, make_tiny_compiler):
    scheduler, runner = support.make_scheduler(num_blocks=20), support.FakeRunner()
    constrained = support.make_request("constrained", [1, 2, 3], priority=0)
    compiled = Future()
    constrained.grammar = RequestGrammar(compiled, deadline=math.inf, timeout_s=1.0)
    behind = support.make_request("behind", [4, 5, 6], priority=1)
    scheduler.add_request(constrained)
    scheduler.add_request(behind)

    for _ in range(3):
        output, _ = support.step(scheduler, runner)
        assert [s.request_id for s in output.scheduled] == ["behind"]
    assert constrained.is_waiting and not constrained.output_token_ids

    regex = StructuredOutputsParams(regex="[0-9]*")
    compiled.set_result(make_tiny_compiler(TOKENS, len(TOKENS) - 1).compile(regex).result())
    constrained.grammar.start([])
    output, _ = support.step(scheduler, runner)
    scheduled = {s.request_id: s for s in output.scheduled}
    assert set(scheduled) == {"constrained", "behind"}
    assert scheduled["constrained"].grammar is constrained.grammar.matcher
    assert scheduled["behind"].grammar is None


def test_a_constrained_request_gets_no_drafts(support, make_tiny_compiler):
    """Speculative decoding leaves a request under a grammar alone (its matcher would have
    to follow the drafts); the free request beside it, with the same repeating history,
    gets drafts."""
    scheduler = support.make_scheduler(num_blocks=20, num_speculative_tokens=4)
    runner = support.ScriptedRunner({"constrained": [1, 2] * 8, "free": [1, 2] * 8})
    regex = StructuredOutputsParams(regex="[0-9]*")
    compiled = Future()
    compiled.set_result(make_tiny_compiler(TOKENS, len(TOKENS) - 1).compile(regex).result())
    constrained = support.make_request("constrained", [1, 2, 1, 2, 1], max_tokens=12)
    constrained.grammar = RequestGrammar(compiled, deadline=math.inf, timeout_s=1.0)
    constrained.grammar.start([])
    scheduler.add_request(constrained)
    scheduler.add_request(support.make_request("free", [1, 2, 1, 2, 1], max_tokens=12))
    drafted = {"constrained": 0, "free": 0}
    for _ in range(4):
        output, _ = support.step(scheduler, runner)
        for scheduled in output.scheduled:
            drafted[scheduled.request_id] += len(scheduled.draft_token_ids)
    assert drafted["constrained"] == 0 and drafted["free"] > 0
