"""Fixtures the bench tests share; their fakes and result builders are in fakes.py."""

import pytest

from bench.serving.workload import PromptMaker, load_prompt_maker


@pytest.fixture(scope="session")
def maker() -> PromptMaker:
    """Prompts from the bundled model's tokenizer (loaded once)."""
    return load_prompt_maker(seed=0)
