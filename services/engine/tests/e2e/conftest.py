"""Shared fixtures of the engine's model-loading tests: the prompts, the HF reference.

The reference is transformers' LlamaForCausalLM loaded (fp32) from the same
converted folder the engine loads, once per session; its greedy continuations
are computed once per prompt, unbatched (no padding).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from conveyor.common.grpc_client import open_channel
from conveyor.v1 import engine_pb2_grpc
from devkit.ports import free_port
from devkit.service_process import ServiceProcess

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 16
TORCH_THREADS = 1
"""The test machine is small and shared; one thread is much faster than two contended ones."""

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fun fact about octopuses."}],
]
PLAIN = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the river, there lived",
]
COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
ANIMALS = ["cat", "dog", "horse", "rabbit", "fox", "owl", "goat", "duck", "bear"]


def long_plain_prompt() -> str:
    lines = [f"Line {i}: the {COLORS[i % 8]} {ANIMALS[i % 9]} walked to the market "
             f"and bought {i % 7 + 2} apples." for i in range(56)]
    return "Here is a log of the animals at the market.\n" + "\n".join(lines) + \
        "\nQuestion: which animal bought apples on line 23? Answer:"


@dataclass(frozen=True)
class PromptCase:
    name: str
    token_ids: list[int]
    chat: list[dict] | None = None
    text: str | None = None


def build_cases(tokenizer) -> list[PromptCase]:
    cases = []
    for i, chat in enumerate(CHATS):
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        cases.append(PromptCase(f"chat{i}", ids, chat=chat))
    for i, text in enumerate([*PLAIN, long_plain_prompt()]):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        cases.append(PromptCase(f"plain{i}", ids, text=text))
    return cases


def truncate_at_eos(tokens: list[int], eos_ids) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


@pytest.fixture(scope="session")
def engine_test_support():
    import torch

    torch.set_num_threads(TORCH_THREADS)
    from conveyor.common.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(MODEL))
    return SimpleNamespace(tokenizer=tokenizer, cases=build_cases(tokenizer), model=MODEL,
                           max_tokens=MAX_TOKENS, torch_threads=TORCH_THREADS)


@pytest.fixture(scope="session")
def hf_greedy(engine_test_support):
    """name -> transformers' greedy continuation (MAX_TOKENS, cut after EOS)."""
    import torch
    from transformers import LlamaForCausalLM

    from conveyor.engine.model.loader import resolve_checkpoint

    folder = resolve_checkpoint(MODEL)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = _eos_ids(model.generation_config.eos_token_id)
    expected = {}
    with torch.inference_mode():
        for case in engine_test_support.cases:
            ids = torch.tensor([case.token_ids])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, pad_token_id=eos[0])
            expected[case.name] = truncate_at_eos(out[0, ids.shape[1]:].tolist(), eos)
    del model
    return expected


def _eos_ids(value) -> list[int]:
    return list(value) if isinstance(value, list | tuple) else [value]


def start_engine(**settings: str) -> ServiceProcess:
    """A started `python -m conveyor.engine` with the bundled model on a free port, one torch
    thread and a small KV pool, Prometheus on `process.metrics_port`; `settings` override
    CONVEYOR_ENGINE_<NAME> by lower-case name (max_model_len="512", ...)."""
    metrics_port = free_port()
    # float32: the tests compare greedy output alone and in a batch, which float32 keeps
    # equal; dtype auto is bfloat16 on a CPU with native bf16, whose greedy output moves with
    # the batch (its accuracy: test_weight_formats_engine.py, docs/performance.md)
    env = {"HF_HUB_OFFLINE": "1", "CONVEYOR_ENGINE_PORT": "0",
           "CONVEYOR_ENGINE_DTYPE": "float32", "CONVEYOR_ENGINE_KV_CACHE_GIB": "0.1",
           "CONVEYOR_ENGINE_TORCH_THREADS": str(TORCH_THREADS),
           "CONVEYOR_ENGINE_METRICS_PORT": str(metrics_port)}
    env.update({f"CONVEYOR_ENGINE_{name.upper()}": value for name, value in settings.items()})
    process = ServiceProcess("conveyor.engine", env).start(timeout_s=300)
    process.metrics_port = metrics_port
    return process


@pytest.fixture(scope="session")
def engine_launcher():
    """`start_engine` (module fixtures start their own engine process with it)."""
    return start_engine


@pytest.fixture
async def stub(engine_process):
    """An Engine stub on a fresh channel to the module's `engine_process` fixture."""
    channel = open_channel(engine_process.address)
    yield engine_pb2_grpc.EngineStub(channel)
    await channel.close()
