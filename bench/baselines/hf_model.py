"""Load the benchmark model into transformers, in fp32 like Conveyor's CPU default.

The engine converts the bundled GGUF once into an HF folder with model.safetensors;
that folder loads in about a second. Without it, transformers dequantizes the GGUF
itself (about 20 s).
"""

from __future__ import annotations

from pathlib import Path

import torch


def converted_folders(model: str) -> list[Path]:
    """Folders that may hold the converted weights, best first."""
    from conveyor.common.models import cache_root, resolve_model

    source = resolve_model(model)
    folders = [source.hf_dir]
    if source.gguf_path is not None:
        folders.append(cache_root() / source.gguf_path.stem)  # the engine's conversion cache
    return folders


def load_hf_model(model: str = "smollm2-135m-instruct", dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of a Conveyor model setting, in eval mode."""
    from transformers import AutoModelForCausalLM

    from conveyor.common.models import load_tokenizer, resolve_model

    source = resolve_model(model)
    tokenizer = load_tokenizer(source)
    for folder in converted_folders(model):
        if (folder / "model.safetensors").is_file() and (folder / "config.json").is_file():
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
            break
    else:
        gguf = source.gguf_path
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    return hf.eval(), tokenizer
