"""devkit/stack.py without a model: what environment a `StackSpec` gives each service, read
back through the services' own settings classes (so a misspelt field name fails here), and
that `Stack.process` layers caller settings and environment over it."""

from __future__ import annotations

from pathlib import Path

from devkit import deploy_manifests as m
from devkit.stack import PIPELINE, Stack, StackSpec

RUNNING = {"tokenizer": 50051, "engine": 50052, "detok": 50053, "gateway": 8000}


def _spec_with_batch(**fields) -> StackSpec:
    return StackSpec(Path("/tmp/logs"), services=(*PIPELINE, "batch"),
                     redis_url="redis://127.0.0.1:6379/3", redis_prefix="run-1",
                     files_dir=Path("/tmp/files"), **fields)


def _settings(spec: StackSpec, service: str):
    """`service`'s settings read from the environment the spec gives it (every CONVEYOR_
    variable must be one of them: a settings class ignores unknown ones)."""
    env = spec.env_of(service, spec.settings_of(service, RUNNING))
    unknown = {key for key in env if key.startswith("CONVEYOR_")} - m.setting_names(service)
    assert not unknown, f"not settings of {service}: {sorted(unknown)}"
    return m.settings_from(service, env)


def test_settings_by_field_name_win_over_the_stacks_own():
    spec = StackSpec(Path("/tmp/logs"), engine={"MAX_MODEL_LEN": "512", "PORT": "7000"},
                     ports={"tokenizer": 50051})
    engine = _settings(spec, "engine")
    assert (engine.max_model_len, engine.port, engine.model) == (512, 7000, spec.model)
    assert _settings(spec, "tokenizer").port == 50051
    assert _settings(spec, "detok").port == 0


def test_the_gateway_dials_the_running_services_and_shares_the_batch_token():
    spec = _spec_with_batch()
    gateway, batch = _settings(spec, "gateway"), _settings(spec, "batch")
    assert (gateway.tokenizer_address, gateway.engine_addresses, gateway.detok_address) == (
        "127.0.0.1:50051", "127.0.0.1:50052", "127.0.0.1:50053")
    assert gateway.auth_enabled is False
    assert gateway.batch_token == batch.gateway_token == spec.batch_token
    assert batch.gateway_url == "http://127.0.0.1:8000"
    assert gateway.files_dir == batch.files_dir == "/tmp/files"
    assert (batch.redis_url, batch.redis_prefix) == ("redis://127.0.0.1:6379/3", "run-1")
    assert _settings(StackSpec(Path("/tmp/logs")), "gateway").batch_token != spec.batch_token


def test_replicas_register_in_the_stacks_namespace_or_nowhere():
    registered = _settings(_spec_with_batch(), "engine")
    assert (registered.redis_url, registered.redis_prefix) == ("redis://127.0.0.1:6379/3",
                                                              "run-1")
    for service in ("tokenizer", "engine", "detok"):
        assert _settings(_spec_with_batch(register_replicas=False), service).redis_url == ""
    assert _settings(_spec_with_batch(register_replicas=False), "gateway").redis_prefix == "run-1"


def test_env_wins_over_settings_and_service_env_over_env_for_its_service_only():
    spec = StackSpec(Path("/tmp/logs"), engine={"MAX_NUM_SEQS": "4"},
                     env={"CONVEYOR_ENGINE_MAX_NUM_SEQS": "8", "OTEL_SERVICE_NAME": "x"},
                     service_env={"engine": {"PYTHONPATH": "/other/checkout"}})
    engine = spec.env_of("engine", spec.settings_of("engine"))
    assert engine["CONVEYOR_ENGINE_MAX_NUM_SEQS"] == "8"
    assert (engine["OTEL_SERVICE_NAME"], engine["PYTHONPATH"]) == ("x", "/other/checkout")
    assert "PYTHONPATH" not in spec.env_of("detok", spec.settings_of("detok"))


def test_an_extra_process_is_the_stacks_with_the_callers_settings_and_env_on_top():
    process = Stack(StackSpec(Path("/tmp/logs"), register_replicas=False)).process(
        "engine", "engine-b", env={"CONVEYOR_ENGINE_ENGINE_ID": "b"}, MAX_NUM_SEQS="2",
        REDIS_URL="redis://elsewhere:6379/0")
    assert (process.module, process.name, process.log_path) == (
        "conveyor.engine", "engine-b", Path("/tmp/logs/engine-b.log"))
    assert process.env["CONVEYOR_ENGINE_MAX_NUM_SEQS"] == "2"
    assert process.env["CONVEYOR_ENGINE_REDIS_URL"] == "redis://elsewhere:6379/0"
    assert process.env["CONVEYOR_ENGINE_ENGINE_ID"] == "b"
