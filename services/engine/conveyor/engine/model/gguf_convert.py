"""One-time conversion of a GGUF checkpoint into an HF safetensors folder.

transformers dequantizes a GGUF on load (slow: ~15-20 s for SmolLM2-135M, fp32;
it also un-permutes q/k) and refuses `save_pretrained` on it, so we write the
state dict, config and tokenizer ourselves into the model's cache folder
(`conveyor.common.models`: CONVEYOR_CACHE_DIR, default ~/.cache/conveyor/models/<key>/)
and load that folder from then on.

Invariant: once `model.safetensors` is in the folder, the folder is complete.
Files are staged in a temporary folder and renamed into place one by one
(config and tokenizer first, the weights last), so a concurrent process sees
either no weights (and converts too; the last rename wins with identical
content) or a whole folder.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from conveyor.common.models import staging_dir

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"


def is_converted(folder: Path) -> bool:
    return (folder / WEIGHTS_FILE).is_file() and (folder / "config.json").is_file()


def convert_gguf(gguf_path: str | Path, target: Path) -> Path:
    """Make `target` an HF folder (config.json, model.safetensors, tokenizer) for
    `gguf_path`, converting on the first call only; returns `target`."""
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if is_converted(target):
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s into %s (one time)", gguf_path.name, target)
    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    with staging_dir(target) as staging:
        _write_config(model.config, Path(staging) / "config.json")
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(staging)
    with staging_dir(target) as staging:
        _write_weights(model, Path(staging) / WEIGHTS_FILE)
    return target


def _write_config(config, path: Path) -> None:
    """config.json without the GGUF quantization entry: the weights are plain now."""
    data = config.to_dict()
    data.pop("quantization_config", None)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_weights(model, path: Path) -> None:
    """The state dict without aliases (safetensors refuses shared storage):
    with tied embeddings lm_head.weight is the embedding matrix, so it is dropped."""
    from safetensors.torch import save_file

    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(path),
              metadata={"format": "pt"})
    path.chmod(0o644)  # staged files are private; the cache is shared by the services
