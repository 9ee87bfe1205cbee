"""Model-name resolution shared by every service."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conveyor.common.models import (
    ModelNotFoundError,
    max_model_len_of,
    resolve_model,
)
from devkit.service_process import without_torch_env


def test_bundled_name_resolves_to_the_packaged_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    source = resolve_model("smollm2-135m-instruct")
    assert source.is_gguf and source.gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.gguf_path.is_file()
    assert source.hf_dir == tmp_path / "smollm2-135m-instruct"


def test_gguf_path_gets_its_own_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    source = resolve_model(str(gguf))
    assert source.gguf_path == gguf.resolve()
    assert source.hf_dir.parent == tmp_path / "cache" and source.hf_dir.name.startswith("tiny-")


def test_hf_folder_is_used_in_place(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    source = resolve_model(str(tmp_path))
    assert not source.is_gguf and source.hf_dir == tmp_path.resolve()


@pytest.mark.parametrize("setting", ["no-such-model", "/nonexistent/dir"])
def test_unknown_model_names_the_setting_to_change(setting):
    with pytest.raises(ModelNotFoundError, match="change the model setting"):
        resolve_model(setting)


class _Config:
    max_position_embeddings = 8192


def test_max_model_len_defaults_to_the_model_and_refuses_more():
    assert max_model_len_of(_Config(), None) == 8192
    assert max_model_len_of(_Config(), 2048) == 2048
    with pytest.raises(ValueError, match="lower max_model_len"):
        max_model_len_of(_Config(), 9000)


@pytest.mark.slow
def test_torch_free_service_gets_a_clear_error_then_works_once_prepared(tmp_path):
    """transformers reads GGUF only with torch; the torch-free services say how to prepare."""
    env = {**os.environ, **without_torch_env(), "CONVEYOR_CACHE_DIR": str(tmp_path),
           "HF_HUB_OFFLINE": "1"}
    load = ("from conveyor.common.models import load_tokenizer, resolve_model; "
            "print(len(load_tokenizer(resolve_model('smollm2-135m-instruct'))))")
    refused = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode != 0
    assert "python -m conveyor.common.prepare_model smollm2-135m-instruct" in refused.stderr
    prepared = subprocess.run([sys.executable, "-m", "conveyor.common.prepare_model"],
                              env={**env, "PYTHONPATH": ""}, capture_output=True, text=True,
                              timeout=120)
    assert prepared.returncode == 0, prepared.stderr
    loaded = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True,
                            text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "49152"
