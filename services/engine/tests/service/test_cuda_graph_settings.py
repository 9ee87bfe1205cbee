"""The CUDA-graph settings reach the model runner, from the environment."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from conveyor.engine.engine_factory import engine_config
from conveyor.engine.settings import EngineSettings


def test_cuda_graph_settings_reach_theengine_config(monkeypatch):
    monkeypatch.setenv("CONVEYOR_ENGINE_CUDA_GRAPHS", "false")
    monkeypatch.setenv("CONVEYOR_ENGINE_CUDA_GRAPH_MAX_BATCH_SIZE", "32")
    config = engine_config(EngineSettings(device="cuda", attention_backend="triton"))
    assert (config.cuda_graphs, config.cuda_graph_max_batch_size) == (False, 32)
    assert not config.uses_cuda_graphs


def test_graphs_are_on_by_default_on_a_gpu():
    config = engine_config(EngineSettings(device="cuda", attention_backend="triton"))
    assert config.uses_cuda_graphs and config.cuda_graph_max_batch_size == 256


def test_a_non_positive_capture_size_is_refused():
    with pytest.raises(ValidationError, match="cuda_graph_max_batch_size"):
        EngineSettings(cuda_graph_max_batch_size=0)
