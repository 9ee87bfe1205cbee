"""A Llama-family decoder over a paged KV cache (Llama 2/3, SmolLM, Mistral, Qwen2).

Inputs are flattened: T tokens of every request in the step, with their
positions; each layer writes its new K/V into its own slice of the pool and
attends through the backend. Nothing is stored between calls except weights:
the KV pool and the step's attention plan are passed in explicitly.

Parameter names follow HF's with q/k/v fused into `qkv_proj` and gate/up into
`gate_up_proj` (weight_loader.py maps the checkpoint onto them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.attention import AttentionBackend
from conveyor.engine.model import fused_ops
from conveyor.engine.model.model_config import ModelConfig
from conveyor.engine.model.rms_norm import RMSNorm
from conveyor.engine.model.rotary_embedding import RotaryEmbedding, apply_rotary


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_proj_bias)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, plan: Any) -> torch.Tensor:
        c = self.config
        num_tokens = hidden.shape[0]
        qk, v = self.qkv_proj(hidden).split([c.q_size + c.kv_size, c.kv_size], dim=-1)
        qk = apply_rotary(qk.view(num_tokens, c.num_attention_heads + c.num_key_value_heads,
                                  c.head_dim), *rotary)  # q and k heads in one call
        q, k = qk.split([c.num_attention_heads, c.num_key_value_heads], dim=1)
        v = v.view(num_tokens, c.num_key_value_heads, c.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, plan)
        return self.o_proj(out.reshape(num_tokens, c.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size,
                                      bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused_ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP around the residual stream, which the caller passes in
    and this layer adds to in place (the add fused with the norm after it, rms_norm.py)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, delta: torch.Tensor | None, residual: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                plan: Any) -> torch.Tensor:
        """`delta`: the previous layer's MLP output, not yet in `residual` (None for the
        first layer); returns this layer's MLP output, likewise not yet added."""
        if delta is None:
            x = self.input_layernorm(residual)
        else:
            x = self.input_layernorm.add_and_norm(residual, delta)
        attn = self.self_attn(x, rotary, kv_cache, plan)
        return self.mlp(self.post_attention_layernorm.add_and_norm(residual, attn))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], plan: Any) -> torch.Tensor:
        rotary = self.rotary_emb.lookup(positions)
        residual = self.embed_tokens(input_ids)  # a new tensor: the layers add to it in place
        delta = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            delta = layer(delta, residual, rotary, kv_cache, plan)
        if delta is None:
            return self.norm(residual)
        return self.norm.add_and_norm(residual, delta)


class LlamaForCausalLM(nn.Module):
    """`forward` gives final hidden states [T, hidden]; `compute_logits` projects
    only the rows the caller picks (those that need a sample) to the vocabulary.
    `lm_head` is None with tied embeddings, unless the loader gave the projection a
    copy of its own (CPU kernels, loader.py)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend)
        self.lm_head = (None if config.tie_word_embeddings else
                        nn.Linear(config.hidden_size, config.vocab_size, bias=False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], plan: Any) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, plan)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)
