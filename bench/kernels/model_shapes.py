"""The model's linear layers: their shapes, the weights a token is multiplied with, model FLOP/s."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LinearShape:
    name: str
    out_features: int
    in_features: int
    per_forward: int  # how many such matmuls one forward pass runs


def load_model_config(model: str = "smollm2-135m-instruct") -> dict:
    from conveyor.common.models import load_config, resolve_model

    return load_config(resolve_model(model)).to_dict()


def model_shapes(config: dict) -> list[LinearShape]:
    """The linear layers of a Llama-family config (HF config.json keys)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config["num_key_value_heads"] * head_dim
    layers = config["num_hidden_layers"]
    return [
        LinearShape("q_proj", heads * head_dim, hidden, layers),
        LinearShape("k_proj/v_proj", kv, hidden, 2 * layers),
        LinearShape("o_proj", hidden, heads * head_dim, layers),
        LinearShape("gate_proj/up_proj", inter, hidden, 2 * layers),
        LinearShape("down_proj", hidden, inter, layers),
        LinearShape("lm_head", config["vocab_size"], hidden, 1),
    ]


def forward_shapes(config: dict) -> list[tuple[int, int]]:
    """(out, in) of every linear of one forward pass in the order it runs them, lm_head last."""
    shapes = model_shapes(config)
    layer = [(s.out_features, s.in_features) for s in shapes[:-1]
             for _ in range(s.per_forward // config["num_hidden_layers"])]
    return layer * config["num_hidden_layers"] + [(shapes[-1].out_features,
                                                    shapes[-1].in_features)]


def params_per_token(config: dict) -> int:
    """Weights every token is multiplied with: all linear layers, lm_head included."""
    return sum(s.out_features * s.in_features * s.per_forward for s in model_shapes(config))


def model_flops(config: dict, tokens_per_s: float) -> float:
    """The model FLOP/s of a throughput: 2 x parameters used per token x tokens/s."""
    return 2.0 * params_per_token(config) * tokens_per_s
