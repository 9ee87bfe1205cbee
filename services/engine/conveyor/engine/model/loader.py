"""Build a ready-to-run model from a checkpoint path (HF folder or .gguf file)."""

from __future__ import annotations

from pathlib import Path

import torch

from conveyor.common.models import resolve_model
from conveyor.engine.attention import AttentionSpec, create_backend
from conveyor.engine.model.cpu_linear import use_cpu_linears
from conveyor.engine.model.gguf_convert import convert_gguf
from conveyor.engine.model.llama import LlamaForCausalLM
from conveyor.engine.model.model_config import ModelConfig
from conveyor.engine.model.quantized_linear import quantize_linears
from conveyor.engine.model.rotary_embedding import RotaryEmbedding
from conveyor.engine.model.weight_loader import load_weights


def resolve_checkpoint(model: str | Path) -> Path:
    """An HF folder for a model setting (bundled name, .gguf path or HF folder; see
    conveyor.common.models): the folder itself, or the GGUF converted once (cached)."""
    source = resolve_model(str(model))
    if source.is_gguf:
        return convert_gguf(source.gguf_path, source.hf_dir)
    return source.hf_dir


def attention_spec(config: ModelConfig, dtype: torch.dtype = torch.float32) -> AttentionSpec:
    return AttentionSpec(num_heads=config.num_attention_heads,
                         num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                         scale=config.head_dim ** -0.5, sliding_window=config.sliding_window,
                         dtype=dtype)


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu",
               attention_backend: str = "torch",
               weight_format: str = "fp32") -> LlamaForCausalLM:
    """Weights of `path` (any model setting) in `dtype` on `device`, in eval mode,
    attention by backend name, decode steps reading `weight_format` (CPU, fp32 only;
    quantized_linear.py).

    The model is built on the meta device and materialized once, so no time or
    memory goes to random initialization.
    """
    folder = resolve_checkpoint(path)
    config = ModelConfig.from_folder(folder)
    backend = create_backend(attention_backend, attention_spec(config, dtype))
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend)
    model = model.to_empty(device=device).to(dtype)
    load_weights(model, folder)
    return ready_for_inference(model, dtype, device, weight_format)


def ready_for_inference(model: LlamaForCausalLM, dtype: torch.dtype,
                        device: str | torch.device,
                        weight_format: str = "fp32") -> LlamaForCausalLM:
    """A model whose weights are in place: rotary tables computed, CPU kernels swapped
    in on the CPU (with `weight_format`'s copy of the weights), eval mode without
    gradients."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_parameters()
    if torch.device(device).type == "cpu":
        use_cpu_kernels(model, dtype)
        quantize_linears(model, weight_format)
    elif weight_format != "fp32":
        raise ValueError(f"weight_format {weight_format!r} has no kernel on {device}; "
                         "use fp32 there")
    return model.eval().requires_grad_(False)


def use_cpu_kernels(model: LlamaForCausalLM, dtype: torch.dtype) -> None:
    """Every linear layer, the vocabulary projection included, through CpuLinear (see
    cpu_linear.py). With tied embeddings the projection reads the embedding matrix itself
    (row-major, as the lookup and the streaming GEMV both want it) plus oneDNN's packed copy
    for larger steps; without the GEMV it gets a column-major copy of its own."""
    if model.lm_head is None:
        model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size,
                                        bias=False, device="meta")
        model.lm_head.weight = model.model.embed_tokens.weight
    use_cpu_linears(model, dtype)
