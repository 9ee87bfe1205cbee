"""docker-compose.yml checked without a Docker engine: services, ports, health checks,
the GPU reservation, start order, that every CONVEYOR_* variable it sets is a setting the
service reads, and that each container runs the command `make run` runs locally."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("run_local", ROOT / "scripts" / "run_local.py")
run_local = importlib.util.module_from_spec(_spec)  # the launcher `make run` uses
sys.modules[_spec.name] = run_local
_spec.loader.exec_module(run_local)

CONVEYOR_SERVICES = {
    "tokenizer": ("conveyor.tokenizer.settings", "TokenizerSettings"),
    "engine": ("conveyor.engine.settings", "EngineSettings"),
    "detok": ("conveyor.detok.settings", "DetokSettings"),
    "gateway": ("conveyor.gateway.settings", "GatewaySettings"),
}


class _ComposeLoader(yaml.SafeLoader):
    """YAML loader that accepts compose's `!reset` tag."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def _load(name: str) -> dict:
    return yaml.load((ROOT / name).read_text(), Loader=_ComposeLoader)


@pytest.fixture(scope="module")
def compose() -> dict:
    return _load("docker-compose.yml")


def test_has_every_service(compose):
    assert set(compose["services"]) >= {"redis", "jaeger", *CONVEYOR_SERVICES}


def test_ports(compose):
    services = compose["services"]
    assert "8000:8000" in services["gateway"]["ports"]
    assert {"16686:16686", "4317:4317"} <= set(services["jaeger"]["ports"])


@pytest.mark.parametrize("service", ["redis", *CONVEYOR_SERVICES])
def test_health_checks(compose, service):
    check = compose["services"][service]["healthcheck"]
    assert check["test"][0] == "CMD" and check["interval"] and check["retries"] >= 3
    if service != "redis":
        assert check["start_period"], "model loading needs a start period"


def test_engine_reserves_an_nvidia_gpu(compose):
    devices = compose["services"]["engine"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_cpu_override_drops_the_gpu_reservation():
    engine = _load("docker-compose.cpu.yml")["services"]["engine"]
    assert engine["deploy"] is None
    assert engine["environment"]["CONVEYOR_ENGINE_DEVICE"] == "cpu"


def test_gateway_waits_for_healthy_dependencies(compose):
    depends = compose["services"]["gateway"]["depends_on"]
    for service in ["redis", "tokenizer", "engine", "detok"]:
        assert depends[service]["condition"] == "service_healthy"


def test_compose_requires_api_keys_and_make_run_turns_them_off_explicitly(compose):
    gateway = compose["services"]["gateway"]["environment"]
    assert str(gateway["CONVEYOR_GATEWAY_AUTH_ENABLED"]).lower() == "true"
    assert gateway["CONVEYOR_GATEWAY_REDIS_URL"].startswith("redis://redis:")
    local = next(s for s in run_local.SERVICES if s.name == "gateway")
    assert local.env["CONVEYOR_GATEWAY_AUTH_ENABLED"] == "false"


def test_gateway_requires_api_keys_by_default():
    from conveyor.gateway.settings import GatewaySettings

    assert GatewaySettings.model_fields["auth_enabled"].default is True


@pytest.mark.parametrize("service", sorted(CONVEYOR_SERVICES))
def test_every_variable_is_a_setting(compose, service):
    module, name = CONVEYOR_SERVICES[service]
    settings = getattr(importlib.import_module(module), name)
    known = {variable for variable, _, _ in settings.describe()}
    env = compose["services"][service]["environment"]
    conveyor_vars = {key for key in env if key.startswith("CONVEYOR_")}
    assert conveyor_vars, f"{service} sets no CONVEYOR_ variables"
    assert conveyor_vars <= known, f"not settings of {name}: {sorted(conveyor_vars - known)}"


@pytest.mark.parametrize("service", sorted(CONVEYOR_SERVICES))
def test_container_runs_what_make_run_runs(compose, service):
    local = next(s for s in run_local.SERVICES if s.name == service)
    command = compose["services"][service]["command"]
    assert command == ["python", "-m", local.module]
    dockerfile = (ROOT / "services" / service / "Dockerfile").read_text()
    cmd = re.search(r"^CMD (.+)$", dockerfile, re.M).group(1)
    assert yaml.safe_load(cmd) == command


@pytest.mark.parametrize("service", sorted(CONVEYOR_SERVICES))
def test_local_run_variables_are_settings(service):
    module, name = CONVEYOR_SERVICES[service]
    settings = getattr(importlib.import_module(module), name)
    known = {variable for variable, _, _ in settings.describe()}
    local = next(s for s in run_local.SERVICES if s.name == service)
    assert set(local.env) <= known, f"not settings of {name}: {sorted(set(local.env) - known)}"
