"""Fixtures of the detokenizer tests: the real SmolLM2 tokenizer."""

from __future__ import annotations

import os

import pytest

from conveyor.common.models import load_tokenizer, resolve_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(resolve_model("smollm2-135m-instruct"))
