"""Jaeger v2: one config file (deploy/kubernetes/base/jaeger/config.yaml) used by compose
and the manifests, whose receivers and ports agree with both and with where the services'
OTEL_* settings send spans (OTLP over gRPC, conveyor.common.tracing)."""

from __future__ import annotations

from urllib.parse import urlparse

import pytest
import yaml

from devkit import deploy_manifests as m

CONFIG_PATH = m.KUBERNETES / "base" / "jaeger" / "config.yaml"
CONVEYOR = tuple(m.SETTINGS_CLASSES)


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CONFIG_PATH.read_text())


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _ports(config: dict) -> dict[str, int]:
    """What Jaeger listens on, by the names the manifests give the ports."""
    protocols = config["receivers"]["otlp"]["protocols"]
    extensions = config["extensions"]
    prometheus = config["service"]["telemetry"]["metrics"]["readers"][0]["pull"]["exporter"]
    return {
        "otlp-grpc": _port(protocols["grpc"]["endpoint"]),
        "otlp-http": _port(protocols["http"]["endpoint"]),
        "ui": _port(extensions["jaeger_query"]["http"]["endpoint"]),
        "metrics": prometheus["prometheus"]["port"],
        "health": _port(extensions["healthcheckv2"]["http"]["endpoint"]),
    }


def test_config_pipes_otlp_into_the_storage_the_ui_reads(config):
    service = config["service"]
    traces = service["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"]
    assert traces["exporters"] == ["jaeger_storage_exporter"]
    assert set(traces["processors"]) <= set(config["processors"])
    backends = config["extensions"]["jaeger_storage"]["backends"]
    assert config["exporters"]["jaeger_storage_exporter"]["trace_storage"] in backends
    assert config["extensions"]["jaeger_query"]["storage"]["traces"] in backends
    assert set(service["extensions"]) == set(config["extensions"])
    for endpoint in (p["endpoint"] for p in config["receivers"]["otlp"]["protocols"].values()):
        assert endpoint.startswith("0.0.0.0:"), "a container must listen on every interface"


def test_compose_runs_jaeger_v2_with_this_config_and_publishes_its_ports(config):
    jaeger = m.load_compose()["services"]["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/jaeger:2.")
    [flag] = jaeger["command"]
    mounted = {m.ROOT / v.split(":")[0]: v.split(":")[1] for v in jaeger["volumes"]}
    assert flag == f"--config={mounted[CONFIG_PATH]}"
    published = {int(p.split(":")[1]) for p in jaeger["ports"]}
    ports = _ports(config)
    assert {ports["otlp-grpc"], ports["otlp-http"], ports["ui"]} <= published


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_manifests_run_the_same_image_with_this_config(config, overlay):
    main = m.container(overlay, "jaeger")
    assert main["image"] == m.load_compose()["services"]["jaeger"]["image"]
    config_map = m.find(overlay, "ConfigMap", "jaeger-config")
    assert config_map["data"]["config.yaml"] == CONFIG_PATH.read_text()
    volume = next(v for v in m.pod_spec(overlay, "jaeger")["volumes"]
                  if v.get("configMap", {}).get("name") == config_map["metadata"]["name"])
    mount = next(v for v in main["volumeMounts"] if v["name"] == volume["name"])
    assert main["args"] == [f"--config={mount['mountPath']}/config.yaml"]


def test_manifest_ports_are_the_config_ports(config):
    main = m.container("cpu", "jaeger")
    container_ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert container_ports == _ports(config)
    service = m.find("cpu", "Service", "jaeger")
    service_ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert {k: container_ports[k] for k in service_ports} == service_ports
    assert main["readinessProbe"]["httpGet"]["port"] == "health"


def _otlp_target(env: dict) -> tuple[str, int]:
    assert env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc") == "grpc"
    url = urlparse(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    return url.hostname, url.port


@pytest.mark.parametrize("service", CONVEYOR)
def test_services_send_spans_to_jaegers_otlp_grpc_receiver(config, service):
    grpc_port = _ports(config)["otlp-grpc"]
    compose = m.load_compose()["services"]
    assert _otlp_target(compose[service]["environment"]) == ("jaeger", grpc_port)
    env = m.container_env("cpu", service)
    assert _otlp_target(env) == ("jaeger", grpc_port)
    assert env["OTEL_SERVICE_NAME"] == compose[service]["environment"]["OTEL_SERVICE_NAME"]
    jaeger_ports = {p["port"] for p in m.find("cpu", "Service", "jaeger")["spec"]["ports"]}
    assert grpc_port in jaeger_ports


def test_the_exporter_speaks_otlp_over_grpc():
    """tracing.py exports with the OTLP/gRPC exporter: the receiver the settings point at."""
    source = (m.ROOT / "common" / "conveyor" / "common" / "tracing.py").read_text()
    assert "opentelemetry.exporter.otlp.proto.grpc" in source
    assert "otlp.proto.http" not in source
