"""Runner errors reach the operator in the engine's setting names."""

from __future__ import annotations

from conveyor.engine.engine_factory import _in_setting_names


def test_runner_advice_names_the_environment_variables():
    message = ("the KV pool holds 0 tokens (0 blocks), less than one sequence of "
               "max_model_len=8192; raise kv_cache_gib or lower max_model_len")
    assert _in_setting_names(message) == (
        "the KV pool holds 0 tokens (0 blocks), less than one sequence of max_model_len=8192; "
        "raise CONVEYOR_ENGINE_KV_CACHE_GIB or lower CONVEYOR_ENGINE_MAX_MODEL_LEN")
