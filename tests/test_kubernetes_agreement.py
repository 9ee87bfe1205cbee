"""The manifests and the services' own settings classes say the same thing, so neither can
drift: every variable a ConfigMap or a container sets is a setting, ports and probes are
the ports the settings bind, readiness asks for the service's own health name (or the
gateway's /ready), drain timings fit the termination grace period, and the addresses the
gateway dials are Services that exist. The same facts in compose: test_compose.py."""

from __future__ import annotations

import importlib
import importlib.util
from urllib.parse import urlparse

import pytest

from devkit import deploy_manifests as m

SERVICES = tuple(m.SETTINGS_CLASSES)
HEALTH_NAMES = {
    "tokenizer": ("conveyor.tokenizer.server", "SERVICE_NAME"),
    "engine": ("conveyor.engine.servicer", "SERVICE_NAME"),
    "detok": ("conveyor.detok.server", "SERVICE_NAME"),
}
PLATFORM_VARIABLES = {"POD_NAME", "POD_IP"}
"""Downward-API variables the manifests set for their own `$(...)` references."""
GRACE_MARGIN_S = 5
"""Seconds the grace period keeps past preStop + drain, for the process to exit."""


def _settings(overlay: str, service: str):
    return m.settings_from(service, m.container_env(overlay, service))


def _pre_stop_s(overlay: str, service: str) -> int:
    hook = m.container(overlay, service).get("lifecycle", {}).get("preStop")
    return hook["sleep"]["seconds"] if hook else 0


@pytest.mark.parametrize("overlay", m.OVERLAYS)
@pytest.mark.parametrize("service", SERVICES)
def test_every_variable_is_a_setting(overlay, service):
    env = m.container_env(overlay, service)
    conveyor = {k for k in env if k.startswith("CONVEYOR_")}
    assert conveyor, f"{service} sets no CONVEYOR_ variables"
    unknown = conveyor - m.setting_names(service)
    assert not unknown, f"not settings of {service}: {sorted(unknown)}"
    other = set(env) - conveyor - PLATFORM_VARIABLES
    assert all(k.startswith("OTEL_") for k in other), sorted(other)
    _settings(overlay, service)  # and the values parse as the service would parse them


@pytest.mark.parametrize("service", SERVICES)
def test_ports_are_the_ports_the_settings_bind(service):
    port = _settings("cpu", service).port
    main = m.container("cpu", service)
    name = "http" if service == "gateway" else "grpc"
    assert m.port_number(main, name) == port
    [svc_port] = [p for p in m.find("cpu", "Service", service)["spec"]["ports"]
                  if p["name"] == name]
    assert svc_port["port"] == port and m.port_number(main, svc_port["targetPort"]) == port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        action = main[probe].get("grpc") or main[probe]["httpGet"]
        assert m.port_number(main, action["port"]) == port, probe


@pytest.mark.parametrize("service", m.GRPC_SERVICES)
def test_grpc_readiness_asks_for_the_service_and_liveness_for_the_server(service):
    module, name = HEALTH_NAMES[service]
    health_name = getattr(importlib.import_module(module), name)
    main = m.container("cpu", service)
    assert main["readinessProbe"]["grpc"].get("service") == health_name
    assert main["livenessProbe"]["grpc"].get("service", "") == ""
    assert main["startupProbe"]["grpc"].get("service", "") == ""
    assert main["startupProbe"]["failureThreshold"] * main["startupProbe"]["periodSeconds"] >= 60


def test_gateway_probes_are_its_ready_and_live_routes():
    from starlette.testclient import TestClient

    from conveyor.gateway.app import create_app
    from conveyor.gateway.settings import GatewaySettings

    main = m.container("cpu", "gateway")
    assert main["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert main["livenessProbe"]["httpGet"]["path"] == "/live"
    assert main["startupProbe"]["httpGet"]["path"] == "/live"
    client = TestClient(create_app(GatewaySettings()))  # no lifespan: not ready, but live
    assert client.get("/live").status_code == 200
    assert client.get("/ready").status_code == 503


@pytest.mark.parametrize("service", SERVICES)
def test_grace_period_covers_pre_stop_and_the_drain(service):
    drain_s = _settings("cpu", service).drain_timeout_s
    grace_s = m.pod_spec("cpu", service)["terminationGracePeriodSeconds"]
    assert grace_s >= _pre_stop_s("cpu", service) + drain_s + GRACE_MARGIN_S


@pytest.mark.parametrize("service", ["gateway", "engine", "detok"])
def test_drain_covers_the_longest_stream(service):
    """A stream lasts at most the gateway's request timeout; the gateway, the engine and
    detok each hold it open, so each drain lets it finish instead of cutting it."""
    longest_s = _settings("cpu", "gateway").request_timeout_s
    assert _settings("cpu", service).drain_timeout_s >= longest_s


def test_tokenizer_drain_covers_a_unary_call():
    assert (_settings("cpu", "tokenizer").drain_timeout_s
            >= _settings("cpu", "gateway").rpc_timeout_s)


def test_gateway_dials_headless_services_that_exist():
    gateway = _settings("cpu", "gateway")
    for service, address in (("tokenizer", gateway.tokenizer_address),
                             ("detok", gateway.detok_address)):
        host, port = address.rsplit(":", 1)
        target = m.find("cpu", "Service", host)
        assert host == service and target["spec"]["clusterIP"] == "None"
        assert int(port) == _settings("cpu", service).port
    assert gateway.engine_address_list == [], "engines are found through the Redis registry"


def test_engine_registers_its_pod_address_and_serves_metrics_on_the_scraped_port():
    engine = _settings("cpu", "engine")
    host, port = engine.advertise_address.rsplit(":", 1)
    assert host == "$(POD_IP)" and int(port) == engine.port
    assert engine.engine_id == "$(POD_NAME)"
    main = m.container("cpu", "engine")
    assert m.port_number(main, "metrics") == engine.metrics_port
    [svc_port] = [p for p in m.find("cpu", "Service", "engine")["spec"]["ports"]
                  if p["name"] == "metrics"]
    assert m.port_number(main, svc_port["targetPort"]) == engine.metrics_port


@pytest.mark.parametrize("service", ["engine", "tokenizer", "detok"])
def test_replicas_register_their_pod_address_where_gateways_look(service):
    """Gateways balance over the replicas registered in Redis: each registers its pod's
    address, in the Redis (the Secret's URL) and namespace the gateways read."""
    settings, gateway = _settings("cpu", service), _settings("cpu", "gateway")
    host, port = settings.advertise_address.rsplit(":", 1)
    assert host == "$(POD_IP)" and int(port) == settings.port
    assert settings.redis_prefix == gateway.redis_prefix
    assert settings.redis_url == gateway.redis_url  # both read from the redis Secret


def test_redis_url_points_at_the_redis_service_with_persistence_and_noeviction():
    import base64

    secret = m.find("cpu", "Secret", "redis")
    url = urlparse(base64.b64decode(secret["data"]["url"]).decode())
    service = m.find("cpu", "Service", url.hostname)
    assert url.port in [p["port"] for p in service["spec"]["ports"]]
    conf = m.find("cpu", "ConfigMap", "redis-config")["data"]["redis.conf"]
    options = dict(line.split(None, 1) for line in conf.splitlines()
                   if line.strip() and not line.startswith("#"))
    assert options["appendonly"] == "yes" and options["maxmemory-policy"] == "noeviction"
    mounts = {v["mountPath"] for v in m.container("cpu", "redis", "StatefulSet")["volumeMounts"]}
    assert options["dir"] in mounts


@pytest.mark.parametrize("service", SERVICES)
def test_container_runs_what_compose_runs(service):
    compose = m.load_compose()["services"][service]
    assert m.container("cpu", service)["command"] == compose["command"]


@pytest.mark.parametrize("service", SERVICES)
def test_manifests_and_compose_agree_on_ports_and_drain(service):
    compose_env = m.load_compose()["services"][service]["environment"]
    in_compose = m.settings_from(service, {k: str(v) for k, v in compose_env.items()})
    in_cluster = _settings("cpu", service)
    assert in_compose.port == in_cluster.port
    assert in_compose.drain_timeout_s == in_cluster.drain_timeout_s


def test_cpu_engine_uses_as_many_torch_threads_as_it_requests_cores():
    requested = m.container("cpu", "engine")["resources"]["requests"]["cpu"]
    assert _settings("cpu", "engine").torch_threads == int(requested)


def test_batch_worker_variables_are_settings():
    env = m.container_env("cpu", "batch")
    conveyor = {k for k in env if k.startswith("CONVEYOR_")}
    assert conveyor and conveyor <= m.setting_names("batch"), sorted(conveyor)
    assert set(env) == conveyor


def test_batch_worker_sends_lines_to_the_gateway_service():
    url = urlparse(_settings("cpu", "batch").gateway_url)
    m.find("cpu", "Service", url.hostname)
    assert url.hostname == "gateway" and url.port == _settings("cpu", "gateway").port


def test_batch_worker_and_gateways_share_the_files_volume_and_redis_namespace():
    batch, gateway = _settings("cpu", "batch"), _settings("cpu", "gateway")
    assert batch.files_dir == gateway.files_dir
    assert batch.redis_prefix == gateway.redis_prefix
    claims = set()
    for name in ("batch", "gateway"):
        volumes = {v["name"]: v for v in m.pod_spec("cpu", name)["volumes"]}
        [mount] = [v for v in m.container("cpu", name)["volumeMounts"]
                   if v["mountPath"] == batch.files_dir]
        claims.add(volumes[mount["name"]]["persistentVolumeClaim"]["claimName"])
    [claim] = claims
    assert m.find("cpu", "PersistentVolumeClaim", claim)["spec"]["accessModes"] == [
        "ReadWriteMany"]


def test_batch_token_comes_from_one_secret_key_on_both_sides():
    refs = set()
    for name, variable in (("batch", "CONVEYOR_BATCH_GATEWAY_TOKEN"),
                           ("gateway", "CONVEYOR_GATEWAY_BATCH_TOKEN")):
        [entry] = [e for e in m.container("cpu", name)["env"] if e["name"] == variable]
        ref = entry["valueFrom"]["secretKeyRef"]
        refs.add((ref["name"], ref["key"]))
        assert variable in m.setting_names(name)
    assert len(refs) == 1


def test_batch_worker_grace_covers_the_lines_in_flight():
    longest_s = min(_settings("cpu", "batch").line_timeout_s,
                    _settings("cpu", "gateway").request_timeout_s)
    grace_s = m.pod_spec("cpu", "batch")["terminationGracePeriodSeconds"]
    assert grace_s >= longest_s + GRACE_MARGIN_S

