"""Unit-test support for the engine service: the real scheduler with a fake model runner.

Helpers reach tests through the `support` fixture (--import-mode=importlib keeps
test modules from importing siblings).
"""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest

from conveyor.common.grpc_client import open_channel
from conveyor.common.grpc_server import ServiceRegistration, start_grpc_server
from conveyor.common.settings import ServiceSettings
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.core.config import EngineConfig
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.core.scheduler_output import (
    ModelRunnerOutput,
    PromptTokenLogprob,
    SampledToken,
    SchedulerOutput,
)
from conveyor.engine.engine_core import EngineCore
from conveyor.engine.engine_info import EngineInfo
from conveyor.engine.metrics import EngineMetrics
from conveyor.engine.servicer import SERVICE_NAME, EngineServicer
from conveyor.v1 import engine_pb2_grpc

VOCAB_SIZE = 100
EOS = 99
GRAMMAR_TOKENS = [f"{i:02d}".encode() for i in range(EOS)] + [b""]
"""The fake vocabulary as grammars see it (make_tiny_compiler): token i is the two digits
of i, EOS is last; the regex [0-9]* allows every output of FakeRunner."""


class FakeRunner:
    """Samples `(last token + 1) % (VOCAB_SIZE - 1)` (never EOS unless told to); drafts
    are accepted while they are what it samples.

    `fail_on` makes a step containing that prompt's first token fail; `step_gate`
    (a threading.Event) holds every step until it is set, so tests can act mid-stream.
    """

    def __init__(self):
        self.fail_on: int | None = None
        self.eos_after: int | None = None
        self.step_gate: threading.Event | None = None
        self.num_steps = 0
        self.num_computed_tokens = 0
        """Tokens the model was given to compute (prompt chunks and decode tokens)."""
        self.finished_seen: list[str] = []

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        self.num_computed_tokens += sum(len(s.token_ids) for s in output.scheduled)
        self.finished_seen.extend(output.finished_request_ids)
        if self.step_gate is not None:
            self.step_gate.wait(5)
        if self.fail_on is not None and any(
                s.prompt_token_ids[0] == self.fail_on for s in output.scheduled):
            raise RuntimeError("injected model failure")
        sampled, prompt_logprobs = {}, {}
        for scheduled in output.scheduled:
            if scheduled.needs_sample:
                sampled[scheduled.request_id] = self._sample(scheduled)
            entries = _prompt_logprobs(scheduled)
            if entries:
                prompt_logprobs[scheduled.request_id] = entries
        return ModelRunnerOutput(sampled, prompt_logprobs)

    def _sample(self, scheduled) -> list[SampledToken]:
        """The next token; with drafts, those that are what it samples next (greedy
        verification) and the token after them."""
        num_prompt = len(scheduled.prompt_token_ids)
        history = scheduled.prompt_token_ids + scheduled.output_token_ids
        tokens = []
        for draft in [*scheduled.draft_token_ids, None]:
            token = self._next(history, len(history) - num_prompt)
            tokens.append(SampledToken(token, logprob=-0.25, top_logprobs=[(1, -0.1), (2, -0.2)]))
            if token != draft:
                break
            history.append(token)
        return tokens

    def _next(self, history: list[int], num_output: int) -> int:
        if self.eos_after is not None and num_output >= self.eos_after:
            return EOS
        return (history[-1] + 1) % (VOCAB_SIZE - 1)


def _prompt_logprobs(scheduled) -> list[PromptTokenLogprob]:
    """For a request asking for prompt logprobs, one entry per prompt position p after the
    first whose predecessor this step computed: logprob -token/100, rank p (so a test can
    tell which positions came, and in what order)."""
    prompt = scheduled.prompt_token_ids
    if scheduled.sampling_params.prompt_logprobs is None or scheduled.output_token_ids:
        return []
    positions = range(scheduled.num_computed_tokens + 1, min(scheduled.seq_len + 1, len(prompt)))
    return [PromptTokenLogprob(-prompt[p] / 100, p, [(prompt[p], -prompt[p] / 100)])
            for p in positions]


def make_core(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 128,
              max_num_batched_tokens: int = 64, max_num_seqs: int = 16,
              enable_prefix_caching: bool = True, grammars=None,
              grammar_compile_timeout_s: float = 10.0, **waiting_bounds) -> EngineCore:
    config = EngineConfig(num_blocks=num_blocks, block_size=block_size,
                             max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             enable_prefix_caching=enable_prefix_caching, **waiting_bounds)
    info = EngineInfo(model="fake", max_model_len=max_model_len, block_size=block_size,
                      num_blocks=num_blocks, vocab_size=VOCAB_SIZE, attention_backend="fake",
                      dtype="float32", engine_id="test-engine", eos_token_ids=(EOS,))
    return EngineCore(Scheduler(config, eos_token_ids=[EOS]), FakeRunner(), info, grammars,
                      grammar_compile_timeout_s)


def run_to_completion(core: EngineCore, max_steps: int = 1000):
    deltas = []
    for _ in range(max_steps):
        if not core.has_unfinished_requests:
            return deltas
        deltas.extend(core.step())
    raise AssertionError("requests did not finish")


@contextlib.asynccontextmanager
async def serve_engine(core: EngineCore, metrics: EngineMetrics | None = None):
    """The Engine service over `core` on a free port: (engine, stub) while it runs."""
    engine = AsyncEngine(core, metrics).start()
    registration = ServiceRegistration(
        SERVICE_NAME, engine_pb2_grpc.add_EngineServicer_to_server, EngineServicer(engine))
    service = await start_grpc_server(ServiceSettings(port=0), [registration])
    channel = open_channel(f"127.0.0.1:{service.port}")
    try:
        yield engine, engine_pb2_grpc.EngineStub(channel)
    finally:
        await channel.close()
        await service.server.stop(grace=None)
        engine.shutdown()


@pytest.fixture
def support():
    return SimpleNamespace(make_core=make_core, run_to_completion=run_to_completion,
                           serve_engine=serve_engine, VOCAB_SIZE=VOCAB_SIZE, EOS=EOS,
                           GRAMMAR_TOKENS=GRAMMAR_TOKENS)
