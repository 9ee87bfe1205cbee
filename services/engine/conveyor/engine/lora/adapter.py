"""Reading a LoRA adapter in PEFT's format onto the model's fused projections.

A PEFT adapter is a folder: `adapter_config.json` (r, lora_alpha, target_modules, ...)
and `adapter_model.safetensors`, with, per adapted projection,
`...layers.{i}.{self_attn|mlp}.{q_proj|...}.lora_A.weight` [r, in] and `lora_B.weight`
[out, r]; the projection's output gains `x @ A^T @ B^T * scaling`, scaling
`lora_alpha / r` (`lora_alpha / sqrt(r)` with use_rslora).

The model fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so an adapter is
kept per fused projection in the layout its LoRA layer computes with (lora_linear.py):
`a` [slices x max_rank, in] stacks each slice's A, zero rows past its rank; `b`
[slices x max_rank, out] holds each slice's B^T (scaling folded in) in that slice's
output columns, zero elsewhere; a projection the adapter leaves alone is zeros.
Anything else PEFT can express (DoRA, biases, modules_to_save, embeddings, lm_head,
per-module ranks) is refused, naming it.

Reading runs on a worker thread, so it does its arithmetic in numpy and keeps the layout in
fp32: a torch op that large would open an OpenMP pool on that thread, and a second pool
stops the engine loop's workers from spinning between a step's regions (docs/performance.md,
"One thread for the engine's torch work"). The slot copy (lora_slots.py, on the loop
thread) rounds to the model's dtype.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from conveyor.engine.model.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

FUSED_PROJECTIONS = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}
"""The model's projection -> (its block, the checkpoint projections fused in it, in order)."""

TARGET_MODULES = tuple(p for _, parts in FUSED_PROJECTIONS.values() for p in parts)

PEFT_DEFAULT_ALPHA = 8
"""LoraConfig's lora_alpha when adapter_config.json leaves it out."""

_WEIGHT_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


class InvalidAdapter(ValueError):
    """The adapter cannot be read or does not fit the model or the engine's bounds."""


@dataclass(frozen=True, slots=True, eq=False)
class LoraAdapter:
    """One adapter in memory. `key` names its contents (sha256 of its two files): the
    prefix cache and the runner's slots know it by that, so a name loaded again from other
    files is another adapter."""

    name: str
    key: str
    rank: int
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    """(layer, fused projection) -> (a, b) in the layout above, fp32; only adapted ones."""


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Fused projection -> (input features, output features of each fused slice)."""
    hidden, inter, kv = config.hidden_size, config.intermediate_size, config.kv_size
    return {"qkv_proj": (hidden, (config.q_size, kv, kv)), "o_proj": (config.q_size, (hidden,)),
            "gate_up_proj": (hidden, (inter, inter)), "down_proj": (inter, (hidden,))}


def read_adapter(name: str, path: str, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read the PEFT adapter in folder `path` for `config`'s model; InvalidAdapter saying
    what is wrong (missing files, an unsupported option, a rank past `max_rank`, a shape
    or layer the model does not have)."""
    folder = Path(path)
    config_bytes = _read(folder / CONFIG_FILE)
    weights_bytes = _read(folder / WEIGHTS_FILE)
    settings = _parse_config(config_bytes, folder)
    rank = settings["r"]
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise InvalidAdapter(f"adapter {name!r} has rank {rank}; this engine takes ranks "
                             f"1-{max_rank} (CONVEYOR_ENGINE_MAX_LORA_RANK)")
    alpha = settings.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    scaling = alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)
    from safetensors.torch import load as load_safetensors

    try:
        tensors = load_safetensors(weights_bytes)
    except Exception as exc:  # safetensors raises its own error types
        raise InvalidAdapter(f"{folder / WEIGHTS_FILE} is not a safetensors file: {exc}") from exc
    pairs = _pairs(tensors, config.num_hidden_layers)
    weights = _fused(pairs, config, rank, max_rank, scaling)
    key = hashlib.sha256(config_bytes + b"\0" + weights_bytes).hexdigest()
    targets = tuple(m for m in TARGET_MODULES if any(p == m for _, p in pairs))
    return LoraAdapter(name, key, rank, targets, weights)


def _read(file: Path) -> bytes:
    try:
        return file.read_bytes()
    except OSError as exc:
        raise InvalidAdapter(f"cannot read {file}: {exc.strerror or exc}") from exc


def _parse_config(raw: bytes, folder: Path) -> dict:
    try:
        settings = json.loads(raw)
    except ValueError as exc:
        raise InvalidAdapter(f"{folder / CONFIG_FILE} is not JSON: {exc}") from exc
    if not isinstance(settings, dict) or "r" not in settings:
        raise InvalidAdapter(f"{folder / CONFIG_FILE} has no rank 'r'")
    if settings.get("peft_type", "LORA") != "LORA":
        raise InvalidAdapter(f"peft_type {settings['peft_type']!r} is not supported (LORA only)")
    refused = {"use_dora": settings.get("use_dora"),
               "modules_to_save": settings.get("modules_to_save"),
               "rank_pattern": settings.get("rank_pattern"),
               "alpha_pattern": settings.get("alpha_pattern"),
               "fan_in_fan_out": settings.get("fan_in_fan_out")}
    for option, value in refused.items():
        if value:
            raise InvalidAdapter(f"adapter option {option}={value!r} is not supported")
    if settings.get("bias", "none") != "none":
        raise InvalidAdapter(f"adapter option bias={settings['bias']!r} is not supported "
                             "(only 'none')")
    return settings


def _pairs(tensors: dict[str, torch.Tensor], num_layers: int
           ) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """(layer, checkpoint projection) -> (A [r, in], B [out, r]) as fp32 arrays."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _WEIGHT_KEY.fullmatch(key)
        if match is None or match[3] not in TARGET_MODULES:
            raise InvalidAdapter(f"adapter weight {key!r} is not supported: LoRA adapts "
                                 f"{', '.join(TARGET_MODULES)} only")
        layer = int(match[1])
        if layer >= num_layers:
            raise InvalidAdapter(f"adapter weight {key!r}: the model has {num_layers} layers")
        halves.setdefault((layer, match[3]), {})[match[4]] = _as_fp32(key, tensor)
    pairs = {}
    for (layer, module), half in halves.items():
        if set(half) != {"A", "B"}:
            raise InvalidAdapter(f"layer {layer} {module}: lora_A and lora_B must both be given")
        pairs[(layer, module)] = (half["A"], half["B"])
    if not pairs:
        raise InvalidAdapter("the adapter has no LoRA weights")
    return pairs


def _as_fp32(key: str, tensor: torch.Tensor) -> np.ndarray:
    """A checkpoint tensor as an fp32 array, by views and numpy alone (bf16: its bits are
    the high half of an fp32's)."""
    if tensor.dtype == torch.bfloat16:
        bits = tensor.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)
    if tensor.dtype in (torch.float32, torch.float16, torch.float64):
        return tensor.numpy().astype(np.float32)
    raise InvalidAdapter(f"adapter weight {key!r} is {tensor.dtype}; LoRA weights are floats")


def _fused(pairs: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]],
           config: ModelConfig, rank: int, max_rank: int, scaling: float
           ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Each adapted (layer, fused projection) in the LoRA layer's layout (module docstring)."""
    shapes = projection_shapes(config)
    fused = {}
    for layer in sorted({layer for layer, _ in pairs}):
        for projection, (_, parts) in FUSED_PROJECTIONS.items():
            if not any((layer, part) in pairs for part in parts):
                continue
            in_features, outs = shapes[projection]
            a = np.zeros((len(parts) * max_rank, in_features), np.float32)
            b = np.zeros((len(parts) * max_rank, sum(outs)), np.float32)
            column = 0
            for i, (part, out_features) in enumerate(zip(parts, outs, strict=True)):
                if (layer, part) in pairs:
                    lora_a, lora_b = pairs[(layer, part)]
                    _check_shape(layer, part, "A", lora_a, (rank, in_features))
                    _check_shape(layer, part, "B", lora_b, (out_features, rank))
                    rows = slice(i * max_rank, i * max_rank + rank)
                    a[rows] = lora_a
                    b[rows, column:column + out_features] = lora_b.T * scaling
                column += out_features
            fused[(layer, projection)] = (torch.from_numpy(a), torch.from_numpy(b))
    return fused


def _check_shape(layer: int, part: str, half: str, tensor: np.ndarray,
                 shape: tuple[int, int]) -> None:
    if tuple(tensor.shape) != shape:
        raise InvalidAdapter(f"layer {layer} {part} lora_{half} has shape {tuple(tensor.shape)}, "
                             f"the model needs {shape}")
