"""Fixtures of the tokenizer tests: the real SmolLM2 tokenizer, a PromptService
over it."""

from __future__ import annotations

import os

import pytest

from conveyor.common.models import load_tokenizer, resolve_model
from conveyor.tokenizer.chat_renderer import ChatRenderer
from conveyor.tokenizer.prompt_service import PromptService
from conveyor.tokenizer.prompt_tokenizer import PromptTokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MAX_MODEL_LEN = 64
"""A short context for the in-process service, so length errors are cheap to hit."""


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def service(tokenizer):
    service = PromptService(PromptTokenizer(tokenizer, (2,)), ChatRenderer(tokenizer),
                            "smollm2-135m-instruct", MAX_MODEL_LEN, num_workers=2)
    yield service
    service.close()
