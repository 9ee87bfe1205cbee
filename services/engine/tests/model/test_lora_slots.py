"""LoraSlots on a small model: a step's adapters are put in the lowest free slots, kept
there while steps use them, and a new adapter goes over the least recently used one the step
does not need; each slot's rank follows its adapter; base rows get slot -1; a step of more
adapters than slots is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.engine.core.scheduler_output import ScheduledRequest
from conveyor.engine.lora.adapter import LoraAdapter
from conveyor.engine.lora.lora_slots import LoraSlots
from conveyor.engine.model.llama import LlamaForCausalLM
from conveyor.engine.model.model_config import ModelConfig
from conveyor.engine.sampling_params import SamplingParams

CONFIG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                     max_position_embeddings=64)


def _adapter(name: str, rank: int) -> LoraAdapter:
    return LoraAdapter(name, f"key-{name}", rank, ("o_proj",),
                       {(0, "o_proj"): (torch.full((4, 16), float(rank)), torch.ones(4, 16))})


def _request(adapter: LoraAdapter | None, num_tokens: int = 1) -> ScheduledRequest:
    return ScheduledRequest("r", [1] * num_tokens, 0, [0], [0] * num_tokens, True,
                            SamplingParams(), [1], [], lora=adapter)


@pytest.fixture
def slots():
    model = LlamaForCausalLM(CONFIG, backend=None)  # never run: only its projections
    return LoraSlots(model, max_loras=2, max_rank=4, dtype=torch.float32,
                     device=torch.device("cpu"))


def _rows(slots) -> list[int]:
    rows = slots.batch.token_slots
    return [] if rows is None else rows.tolist()


def test_lowest_free_slots_then_least_recently_used_out(slots):
    a, b, c = _adapter("a", 1), _adapter("b", 2), _adapter("c", 3)
    slots.set_step([_request(None, 2), _request(a), _request(b, 2)])
    assert _rows(slots) == [-1, -1, 0, 1, 1]
    assert slots.batch.ranks.tolist() == [1, 2]
    o_proj = slots.projections[(0, "o_proj")]
    assert torch.all(o_proj.a[0:4] == 1.0) and torch.all(o_proj.a[4:8] == 2.0)
    slots.set_step([_request(b)])  # a is now the least recently used
    slots.set_step([_request(b), _request(c)])
    assert _rows(slots) == [1, 0] and slots.batch.ranks.tolist() == [3, 2]
    assert torch.all(o_proj.a[0:4] == 3.0)
    assert torch.all(slots.projections[(1, "o_proj")].a == 0)  # c leaves layer 1 alone
    slots.set_step([_request(None)])
    assert slots.batch.token_slots is None and slots.batch.native is None


def test_more_adapters_than_slots_in_one_step_is_refused(slots):
    with pytest.raises(ValueError, match="max_loras=2"):
        slots.set_step([_request(_adapter(name, 1)) for name in "abc"])
    assert np.all(slots.batch.ranks.numpy() >= 0)
