"""A request's constraint while it runs: its grammar (a future until compiled), then its matcher."""

from __future__ import annotations

from concurrent.futures import Future

from conveyor.engine.structured.errors import InvalidConstraint
from conveyor.engine.structured.grammar_compiler import CompiledGrammar
from conveyor.engine.structured.grammar_matcher import GrammarMatcher

TIMEOUT_SETTING = "CONVEYOR_ENGINE_GRAMMAR_COMPILE_TIMEOUT_S"


class RequestGrammar:
    """The constraint of one scheduler request (one sample of n).

    Until `start` it waits for its grammar and the scheduler passes the request over
    (vLLM's WAITING_FOR_FSM); `start` gives it a matcher of its own, advanced over the
    output it already has. From then on `matcher` is set and follows the request's
    output: the scheduler advances it by each token it appends, so it survives
    preemption (the output tokens stay).
    """

    __slots__ = ("compiled", "deadline", "timeout_s", "matcher")

    def __init__(self, compiled: Future[CompiledGrammar], deadline: float,
                 timeout_s: float) -> None:
        self.compiled = compiled
        self.deadline = deadline
        """time.monotonic() by which the grammar must have compiled."""
        self.timeout_s = timeout_s
        self.matcher: GrammarMatcher | None = None

    @property
    def is_started(self) -> bool:
        return self.matcher is not None

    def can_start(self, now: float) -> bool:
        """Whether `start` has an answer now: compiled, failed, or past the deadline."""
        return self.compiled.done() or now >= self.deadline

    def start(self, output_token_ids: list[int]) -> None:
        """Give the request its matcher, advanced over `output_token_ids`. Raises
        InvalidConstraint: the grammar does not compile, did not compile in time, or the
        output breaks it."""
        if not self.compiled.done():
            raise InvalidConstraint(
                f"structured output did not compile within {self.timeout_s:g} s "
                f"({TIMEOUT_SETTING}); simplify it")
        matcher = self.compiled.result().new_matcher()
        error = matcher.accept_all(output_token_ids)
        if error is not None:
            raise InvalidConstraint("resume_output_token_ids do not follow the structured "
                                    f"output: {error}")
        self.matcher = matcher

    def accept(self, token_id: int) -> None:
        self.matcher.accept(token_id)
