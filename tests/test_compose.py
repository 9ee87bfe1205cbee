"""docker-compose.yml checked without a Docker engine: services, ports, health checks,
the GPU reservation, start order, that every CONVEYOR_* variable it sets is a setting the
service reads, that each container runs the command `make run` runs locally, that health
checks probe the ports the settings bind, that stop_grace_period covers each drain, and
Redis's persistence. The same facts in the Kubernetes manifests: test_kubernetes_agreement.py."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml

from devkit import deploy_manifests as m
from devkit.service_process import settings_env
from devkit.stack import module_of

ROOT = Path(__file__).resolve().parent.parent


def _load_by_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


run_local = _load_by_path("run_local", ROOT / "scripts" / "run_local.py")  # `make run`'s
CONVEYOR_SERVICES = m.SETTINGS_CLASSES
_load = m.load_compose
GRACE_MARGIN_S = 5
"""Seconds stop_grace_period keeps past the drain, for the process to exit."""


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
    # the base file's GPU choices (bfloat16, triton) are replaced by `make run`'s CPU choices
    assert engine["environment"]["CONVEYOR_ENGINE_DTYPE"] == "auto"
    assert engine["environment"]["CONVEYOR_ENGINE_ATTENTION_BACKEND"] == "auto"


def test_gateway_waits_for_healthy_dependencies(compose):
    depends = compose["services"]["gateway"]["depends_on"]
    for service in ["redis", "tokenizer", "engine", "detok"]:
        assert depends[service]["condition"] == "service_healthy"


def test_compose_requires_api_keys_and_make_run_turns_them_off_explicitly(compose):
    gateway = compose["services"]["gateway"]["environment"]
    assert str(gateway["CONVEYOR_GATEWAY_AUTH_ENABLED"]).lower() == "true"
    assert gateway["CONVEYOR_GATEWAY_REDIS_URL"].startswith("redis://redis:")
    assert run_local.local_spec({}).settings_of("gateway")["AUTH_ENABLED"] == "false"


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
    assert service in run_local.SERVICES
    command = compose["services"][service]["command"]
    assert command == ["python", "-m", module_of(service)]
    dockerfile = (ROOT / "services" / service / "Dockerfile").read_text()
    cmd = re.search(r"^CMD (.+)$", dockerfile, re.M).group(1)
    assert yaml.safe_load(cmd) == command


@pytest.mark.parametrize("service", sorted(CONVEYOR_SERVICES))
def test_local_run_variables_are_settings(service):
    module, name = CONVEYOR_SERVICES[service]
    settings = getattr(importlib.import_module(module), name)
    known = {variable for variable, _, _ in settings.describe()}
    spec = run_local.local_spec({})
    local = set(settings_env(service, spec.settings_of(service, run_local.PORTS)))
    assert local <= known, f"not settings of {name}: {sorted(local - known)}"


def _settings(compose: dict, service: str):
    env = compose["services"][service]["environment"]
    return m.settings_from(service, {k: str(v) for k, v in env.items()})


def _seconds(duration: str) -> float:
    """A compose duration such as 305s, 1m30s or 2m."""
    parts = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts and duration, f"unsupported duration {duration!r}"
    return int(parts.group(1) or 0) * 60 + int(parts.group(2) or 0)


@pytest.mark.parametrize("service", m.GRPC_SERVICES)
def test_grpc_health_checks_probe_the_bound_port(compose, service):
    check = compose["services"][service]["healthcheck"]["test"]
    assert check[1:4] == ["python", "-m", "conveyor.common.healthcheck"]
    assert check[4] == f"127.0.0.1:{_settings(compose, service).port}"


def test_gateway_health_check_is_readiness_on_its_port(compose):
    check = compose["services"]["gateway"]["healthcheck"]["test"]
    assert check[1:4] == ["python", "-m", "conveyor.common.healthcheck"]
    assert check[4] == f"http://127.0.0.1:{_settings(compose, 'gateway').port}/ready"


@pytest.mark.parametrize("service", sorted(CONVEYOR_SERVICES))
def test_stop_grace_period_covers_the_drain(compose, service):
    grace_s = _seconds(compose["services"][service]["stop_grace_period"])
    assert grace_s >= _settings(compose, service).drain_timeout_s + GRACE_MARGIN_S


@pytest.mark.parametrize("service", ["gateway", "engine", "detok"])
def test_drain_covers_the_longest_stream(compose, service):
    longest_s = _settings(compose, "gateway").request_timeout_s
    assert _settings(compose, service).drain_timeout_s >= longest_s


@pytest.mark.parametrize("service", sorted(CONVEYOR_SERVICES))
def test_read_only_root_with_tmp(compose, service):
    spec = compose["services"][service]
    assert spec["read_only"] is True and "/tmp" in spec["tmpfs"]


def test_engine_writes_only_to_named_volumes(compose):
    engine = compose["services"]["engine"]
    mounts = dict(v.split(":", 1) for v in engine["volumes"])
    assert mounts == {"model-cache": "/models", "compile-cache": "/cache"}
    assert set(mounts) <= set(compose["volumes"])


def test_redis_persists_and_never_evicts(compose):
    redis = compose["services"]["redis"]
    command = redis["command"]
    options = dict(zip(command[1::2], command[2::2], strict=True))
    assert options["--appendonly"] == "yes" and options["--maxmemory-policy"] == "noeviction"
    assert [v.split(":")[1] for v in redis["volumes"]] == ["/data"]


def test_gateway_dials_the_compose_services(compose):
    gateway = _settings(compose, "gateway")
    for service, address in (("tokenizer", gateway.tokenizer_address),
                             ("detok", gateway.detok_address)):
        assert address == f"{service}:{_settings(compose, service).port}"
    assert gateway.engine_address_list == [f"engine:{_settings(compose, 'engine').port}"]


def test_batch_worker_variables_are_settings_and_agree_with_the_gateway(compose):
    env = {k: str(v) for k, v in compose["services"]["batch"]["environment"].items()}
    assert set(env) <= m.setting_names("batch"), sorted(set(env) - m.setting_names("batch"))
    batch, gateway = m.settings_from("batch", env), _settings(compose, "gateway")
    assert batch.gateway_url == f"http://gateway:{gateway.port}"
    assert batch.gateway_token == gateway.batch_token != ""
    assert batch.redis_url == gateway.redis_url and batch.files_dir == gateway.files_dir
    for service in ("batch", "gateway"):
        mounts = dict(v.split(":", 1) for v in compose["services"][service]["volumes"])
        assert mounts["batch-files"] == batch.files_dir


def test_batch_worker_stop_lets_its_lines_in_flight_finish(compose):
    env = {k: str(v) for k, v in compose["services"]["batch"]["environment"].items()}
    longest_s = min(m.settings_from("batch", env).line_timeout_s,
                    _settings(compose, "gateway").request_timeout_s)
    grace_s = _seconds(compose["services"]["batch"]["stop_grace_period"])
    assert grace_s >= longest_s + GRACE_MARGIN_S


def test_batch_container_runs_its_image_command(compose):
    dockerfile = (ROOT / "services" / "batch" / "Dockerfile").read_text()
    cmd = re.search(r"^CMD (.+)$", dockerfile, re.M).group(1)
    assert compose["services"]["batch"]["command"] == yaml.safe_load(cmd)
