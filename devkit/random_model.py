"""Llama models of named shapes with random weights: speed checks without checkpoints.

bench/gpu.py runs on a bare GPU machine with no model files, so it times the engine
on these (a step's cost depends on the shapes, not the values); the GPU tests check it
on them, the CPU tests on the tiny one. Weights are N(0, 0.02), norms 1, so activations stay finite.
"""

from __future__ import annotations

import torch

from conveyor.engine.attention import create_backend
from conveyor.engine.model.llama import LlamaForCausalLM
from conveyor.engine.model.loader import attention_spec, ready_for_inference
from conveyor.engine.model.model_config import ModelConfig

SHAPES = {
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, eos_token_ids=(2,)),
    "llama-3.2-1b": ModelConfig(  # max_position_embeddings cut from 131072: tables stay small
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, eos_token_ids=(128001,)),
    "tiny": ModelConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, tie_word_embeddings=True, eos_token_ids=(1,)),
}
"""Decoder shapes by name (SmolLM2-135M's, Llama-3.2-1B's, and a tiny one for tests)."""


def random_llama(shape: str, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", attention_backend: str = "torch",
                 seed: int = 0) -> LlamaForCausalLM:
    """A model of SHAPES[shape] with seeded random weights, ready like load_model's."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; choose one of {sorted(SHAPES)}")
    config = SHAPES[shape]
    with torch.device("meta"):
        model = LlamaForCausalLM(config, create_backend(attention_backend,
                                                        attention_spec(config, dtype)))
    model = model.to_empty(device=device).to(dtype)
    generator = torch.Generator(device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=generator)
    return ready_for_inference(model, dtype, device)
