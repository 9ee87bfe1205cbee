"""Fixtures of the detokenizer tests: the real SmolLM2 tokenizer, and scripted engines
(scripted_engine.py, importable as `detok_scripted_engine` once this file is loaded)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from conveyor.common.models import load_tokenizer, resolve_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _load_scripted_engine():
    """scripted_engine.py by path (the tests folder is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "detok_scripted_engine", Path(__file__).with_name("scripted_engine.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


scripted_engine = _load_scripted_engine()


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(resolve_model("smollm2-135m-instruct"))


@pytest.fixture
async def serve_engine():
    """`await serve_engine(engine) -> address`: a ScriptedEngine served on a free port
    until the test ends."""
    services = []

    async def serve(engine) -> str:
        services.append(await scripted_engine.serve(engine))
        return f"127.0.0.1:{services[-1].port}"

    yield serve
    for service in services:
        await service.server.stop(grace=None)
