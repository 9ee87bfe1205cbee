"""Load an HF safetensors checkpoint into LlamaForCausalLM's (fused) parameters."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from conveyor.engine.model.llama import LlamaForCausalLM

# checkpoint suffix -> (our parameter suffix, shard index) for fused projections.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_FUSED_NAME = re.compile(r"^(.*)\.(self_attn\.[qkv]_proj|mlp\.(?:gate|up)_proj)\.(weight|bias)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def load_weights(model: LlamaForCausalLM, folder: str | Path) -> None:
    """Copy every tensor of folder/*.safetensors into the model (casting dtype).

    Invariant on return: every parameter was written (a checkpoint missing one
    raises, naming it), so a model built on the meta device is safe to use.
    """
    params = dict(model.named_parameters())
    written: set[tuple[str, int]] = set()
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                piece = _load_one(model, params, name, f.get_tensor(name))
                if piece:
                    written.add(piece)
    missing = sorted(name for name, _ in _expected_pieces(params) - written)
    if missing:
        raise ValueError(f"checkpoint in {folder} lacks weights for: {missing[:5]}")


def _expected_pieces(params: dict[str, torch.nn.Parameter]) -> set[tuple[str, int]]:
    """(parameter, shard) pairs a complete checkpoint fills; shard 0 for unfused ones."""
    shards = {"qkv_proj": 3, "gate_up_proj": 2}
    pieces = set()
    for name in params:
        module = name.rsplit(".", 2)[-2]
        pieces.update((name, shard) for shard in range(shards.get(module, 1)))
    return pieces


def _load_one(model: LlamaForCausalLM, params: dict[str, torch.nn.Parameter], name: str,
              tensor: torch.Tensor) -> tuple[str, int] | None:
    """Write one checkpoint tensor; return the (parameter, shard) it filled, None if skipped."""
    if _IGNORED.search(name) or (name == "lm_head.weight" and model.lm_head is None):
        return None
    fused = _FUSED_NAME.match(name)
    if fused is None:
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        params[name].data.copy_(tensor)
        return name, 0
    prefix, part, kind = fused.groups()
    target_part, shard = _FUSED[part]
    target = f"{prefix}.{target_part}.{kind}"
    _shard_view(params[target], target_part, shard, model).copy_(tensor)
    return target, shard


def _shard_view(param: torch.nn.Parameter, part: str, shard: int,
                model: LlamaForCausalLM) -> torch.Tensor:
    """The rows of a fused parameter that one checkpoint projection fills."""
    c = model.config
    sizes = ([c.q_size, c.kv_size, c.kv_size] if part == "self_attn.qkv_proj"
             else [c.intermediate_size, c.intermediate_size])
    return param.data.split(sizes, dim=0)[shard]
