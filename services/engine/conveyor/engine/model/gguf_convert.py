"""One-time conversion of a GGUF checkpoint into an HF safetensors folder.

transformers dequantizes a GGUF on load (slow: ~15-20 s for SmolLM2-135M, fp32)
and refuses `save_pretrained` on it, so we write the state dict, config and
tokenizer ourselves into a cache folder and load that folder from then on.

Invariant: a folder returned by `convert_gguf` is complete. It is written to a
temporary sibling and renamed into place, so a concurrent process either sees
no folder (and converts too; the loser of the rename race discards its copy)
or a whole one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "CONVEYOR_CACHE_DIR"
COMPLETE_MARKER = "model.safetensors"


def cache_root() -> Path:
    """Where converted models live: $CONVEYOR_CACHE_DIR/models, else ~/.cache/conveyor/models."""
    base = os.environ.get(CACHE_DIR_ENV)
    root = Path(base) if base else Path.home() / ".cache" / "conveyor"
    return root / "models"


def converted_dir(gguf_path: str | os.PathLike[str], cache_dir: Path | None = None) -> Path:
    """The folder a GGUF converts into (named after the file's stem)."""
    return (cache_dir or cache_root()) / Path(gguf_path).stem


def convert_gguf(gguf_path: str | os.PathLike[str], cache_dir: Path | None = None) -> Path:
    """Return an HF folder (config.json, model.safetensors, tokenizer) for `gguf_path`.

    Converts on the first call and reuses the folder afterwards.
    """
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    target = converted_dir(gguf_path, cache_dir)
    if (target / COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s into %s (one time)", gguf_path.name, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_hf_folder(gguf_path, tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_hf_folder(gguf_path: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    state = _unshared_state_dict(model)
    save_file(state, str(out / COMPLETE_MARKER), metadata={"format": "pt"})
    _write_config(model.config, out / "config.json")
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(str(out))


def _write_config(config, path: Path) -> None:
    """config.json without the GGUF quantization entry: the weights are plain now."""
    data = config.to_dict()
    data.pop("quantization_config", None)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _unshared_state_dict(model) -> dict:
    """The state dict without aliases (safetensors refuses shared storage).

    With tied embeddings lm_head.weight is the embedding matrix; drop it.
    """
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {k: v.detach().contiguous() for k, v in state.items()}


def _publish(tmp: Path, target: Path) -> None:
    try:
        os.rename(tmp, target)
    except OSError:
        # Another process published first (target exists and is non-empty).
        if not (target / COMPLETE_MARKER).is_file():
            raise
