"""Loading HF safetensors folders of tiny random Llama / Qwen2 / Mistral models and
matching transformers on them: Llama-3 rope scaling, q/k/v (and o) biases, untied
and tied embeddings, a sliding window, and the triton backend end to end."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine.model.loader import load_model
from conveyor.engine.model.model_config import ModelConfig

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def llama3_config():
    from transformers import LlamaConfig

    return LlamaConfig(**COMMON, attention_bias=True, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                        "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 16})


def qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(**COMMON, tie_word_embeddings=True)


def mistral_config():
    from transformers import MistralConfig

    return MistralConfig(**COMMON, sliding_window=8, tie_word_embeddings=False)


CONFIGS = {"llama3": llama3_config, "qwen2": qwen2_config, "mistral": mistral_config}


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    """(folder, transformers model) of a random tiny model saved as safetensors."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[request.param](), dtype=torch.float32)
    hf = hf.eval()
    with torch.no_grad():  # random biases, so a dropped bias would show
        for name, param in hf.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return request.param, folder, hf


def test_config_reads_the_interesting_fields(tiny):
    name, folder, _ = tiny
    config = ModelConfig.from_folder(folder)
    assert config.head_dim == 16 and config.num_queries_per_kv == 2
    if name == "llama3":
        assert config.rope_scaling.rope_type == "llama3" and config.rope_scaling.factor == 8.0
        assert config.attention_bias and config.o_proj_bias and not config.tie_word_embeddings
    if name == "qwen2":
        assert config.attention_bias and not config.o_proj_bias and config.tie_word_embeddings
        assert config.sliding_window is None
    if name == "mistral":
        assert config.sliding_window == 8


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_generation_matches_transformers(tiny, backend, make_driver):
    from conveyor.engine.core.config import EngineConfig
    from conveyor.engine.worker.model_runner import ModelRunner

    _, folder, hf = tiny
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    runner = ModelRunner(EngineConfig(model=str(folder), attention_backend=backend,
                                      device=device,
                                      block_size=4, num_blocks=64, max_model_len=64,
                                      max_num_batched_tokens=32, max_num_seqs=4))
    prompts = {"a": [5, 17, 33, 2, 9, 60, 61, 62, 1, 3, 4, 90, 11, 12, 13, 14, 15, 16, 20, 21],
               "b": [7, 8], "c": [40, 41, 42, 43, 44]}
    driver = make_driver(runner, token_budget=7)
    arrivals = {0: [("a", prompts["a"], 10)], 1: [("b", prompts["b"], 10)],
                3: [("c", prompts["c"], 10)]}
    outputs = driver.run(arrivals)
    for rid, prompt in prompts.items():
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=10, min_new_tokens=10, pad_token_id=0)
        assert outputs[rid] == expected[0, len(prompt):].tolist(), rid


def test_full_sequence_logits_match(tiny):
    """All positions of a 30-token sequence (past the sliding window) in one step."""
    from conveyor.engine.attention import AttentionMetadata

    _, folder, hf = tiny
    model = load_model(folder)
    num_tokens, block_size = 30, 4
    ids = torch.randint(0, 96, (num_tokens,), generator=torch.Generator().manual_seed(1))
    blocks = torch.randperm(8, generator=torch.Generator().manual_seed(2)).int()
    positions = torch.arange(num_tokens)
    meta = AttentionMetadata(
        slot_mapping=blocks[positions // block_size].long() * block_size + positions % block_size,
        positions=positions, token_request=torch.zeros(num_tokens, dtype=torch.long),
        query_start_loc=torch.tensor([0, num_tokens]), seq_lens=torch.tensor([num_tokens]),
        block_tables=blocks[None], block_size=block_size, max_query_len=num_tokens,
        max_seq_len=num_tokens)
    caches = [torch.zeros(2, 8, block_size, 2, 16) for _ in range(2)]
    backend = model.model.layers[0].self_attn.backend
    with torch.inference_mode():
        ours = model.compute_logits(model(ids, positions, caches, backend.plan(meta)))
        expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
