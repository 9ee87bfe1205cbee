"""The architecture facts the engine needs, read once from an HF config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling; rope_type is "default", "linear" or "llama3"."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2).

    Invariants: num_attention_heads is a multiple of num_key_value_heads (GQA);
    head_dim * num_attention_heads need not equal hidden_size.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on q/k/v projections (Qwen2, and Llama configs with attention_bias)."""
    o_proj_bias: bool = False
    """Bias on the output projection (Llama's attention_bias; Qwen2 has none)."""
    sliding_window: int | None = None
    """Each token attends to at most this many latest positions (Mistral)."""
    model_type: str = "llama"
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from an HF config dict (transformers 4.x or 5.x field names)."""
        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; "
                             f"supported: {sorted(SUPPORTED_MODEL_TYPES)}")
        num_heads = raw["num_attention_heads"]
        num_kv_heads = raw.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of "
                             f"num_key_value_heads {num_kv_heads}")
        if raw.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        rope_params = _rope_parameters(raw)
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(rope_params),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            o_proj_bias=model_type == "llama" and bool(raw.get("attention_bias", False)),
            sliding_window=_sliding_window(raw, model_type),
            model_type=model_type,
            eos_token_ids=_as_tuple(raw.get("eos_token_id")),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(folder) / "config.json").read_text()))


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 puts theta and scaling in rope_parameters; 4.x in rope_scaling."""
    return dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})


def _rope_scaling(params: dict[str, Any]) -> RopeScaling:
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"rope_type {rope_type!r} is not supported (default, linear, llama3)")
    return RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", 8192)),
    )


def _sliding_window(raw: dict[str, Any], model_type: str) -> int | None:
    """Mistral's window applies to every layer. Qwen2 configs carry a window but use it
    only with use_sliding_window, and then on some layers only: not supported."""
    if model_type == "qwen2":
        if raw.get("use_sliding_window"):
            raise ValueError("Qwen2 with use_sliding_window=true is not supported")
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)
