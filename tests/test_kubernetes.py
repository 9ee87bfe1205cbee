"""deploy/kubernetes without a cluster: every overlay renders (`kubectl kustomize`), each
object validates strictly against the Kubernetes schemas of a pinned version, and the
custom resources, autoscalers, budgets, network policy and pod security say what the
controllers and the docs expect. Agreement with the services' settings:
test_kubernetes_agreement.py."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest

from devkit import deploy_manifests as m

CUSTOM_KINDS = {"ScaledObject", "ServiceMonitor"}
"""Custom resources: no Kubernetes schema; their fields are checked below instead."""
CONVEYOR = ("gateway", "tokenizer", "engine", "detok")


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_overlay_renders_every_part(overlay):
    kinds = {(o["kind"], o["metadata"]["name"]) for o in m.render(overlay)}
    for name in [*CONVEYOR, "jaeger"]:
        assert ("Deployment", name) in kinds and ("Service", name) in kinds
    assert ("StatefulSet", "redis") in kinds and ("ScaledObject", "engine") in kinds
    assert {o["metadata"].get("namespace") for o in m.render(overlay)
            if o["kind"] != "Namespace"} == {"conveyor"}


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_every_object_validates_strictly(overlay):
    skipped = set()
    for obj in m.render(overlay):
        if obj["kind"] in CUSTOM_KINDS:
            skipped.add(obj["kind"])
            continue
        try:
            kubernetes_validate.validate(obj, m.KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(p) for p in error.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {error.message}")
    assert skipped == CUSTOM_KINDS


def test_strict_validation_catches_an_unknown_field():
    """The validator is strict: a misspelt field fails (so the test above means something)."""
    deployment = m.find("cpu", "Deployment", "gateway")
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, m.KUBERNETES_VERSION, strict=True)


def test_scaled_object_scales_the_engine_on_its_waiting_requests():
    from conveyor.engine.metrics import EngineMetrics

    scaled = m.find("cpu", "ScaledObject", "engine")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    assert (target.get("kind", "Deployment"), target["name"]) == ("Deployment", "engine")
    m.find("cpu", "Deployment", target["name"])
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    [trigger] = spec["triggers"]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    assert re.match(r"^https?://[\w.-]+:\d+$", meta["serverAddress"])
    assert isinstance(meta["threshold"], str) and float(meta["threshold"]) > 0
    exported = _metric_names(EngineMetrics("m", "e").registry)
    assert set(re.findall(r"(?:vllm|conveyor):\w+", meta["query"])) == {"vllm:num_requests_waiting"}
    assert "vllm:num_requests_waiting" in exported


def test_service_monitors_scrape_named_ports_that_serve_metrics():
    services = m.objects("cpu", "Service")
    for monitor in m.objects("cpu", "ServiceMonitor"):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        spec = monitor["spec"]
        selected = [s for s in services if m.matches(spec["selector"], s["metadata"]["labels"])]
        assert len(selected) == 1, f"{monitor['metadata']['name']} selects {len(selected)}"
        port_names = {p["name"] for p in selected[0]["spec"]["ports"]}
        for endpoint in spec["endpoints"]:
            assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"


def test_engine_and_gateway_metrics_are_scraped():
    monitored = {mon["metadata"]["name"] for mon in m.objects("cpu", "ServiceMonitor")}
    assert {"gateway", "engine"} <= monitored


@pytest.mark.parametrize("name", ["gateway", "tokenizer", "detok"])
def test_stateless_services_autoscale_on_cpu(name):
    hpa = m.find("cpu", "HorizontalPodAutoscaler", name)
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", name)
    assert [x["resource"]["name"] for x in hpa["spec"]["metrics"]] == ["cpu"]
    assert m.container("cpu", name)["resources"]["requests"]["cpu"], "HPA needs a CPU request"
    assert hpa["spec"]["minReplicas"] >= 2, "one replica could not drain without a gap"


@pytest.mark.parametrize("name", CONVEYOR)
def test_disruption_budgets_cover_each_service(name):
    budget = m.find("cpu", "PodDisruptionBudget", name)
    labels = m.find("cpu", "Deployment", name)["spec"]["template"]["metadata"]["labels"]
    assert m.matches(budget["spec"]["selector"], labels)
    assert budget["spec"]["maxUnavailable"] == 1


def _ingress_rules(pod_labels: dict) -> list[dict]:
    rules = []
    for policy in m.objects("cpu", "NetworkPolicy"):
        if m.matches(policy["spec"]["podSelector"], pod_labels):
            rules.extend(policy["spec"].get("ingress", []))
    return rules


def _pod_labels(kind: str, name: str) -> dict:
    return m.find("cpu", kind, name)["spec"]["template"]["metadata"]["labels"]


def test_ingress_is_denied_unless_a_policy_opens_it():
    deny = m.find("cpu", "NetworkPolicy", "default-deny-ingress")["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"]
    assert "ingress" not in deny


def test_only_the_gateway_is_open_to_other_namespaces():
    workloads = [("Deployment", d["metadata"]["name"]) for d in m.objects("cpu", "Deployment")]
    for kind, name in [*workloads, ("StatefulSet", "redis")]:
        for rule in _ingress_rules(_pod_labels(kind, name)):
            sources = rule.get("from")
            if name == "gateway":
                assert sources is None  # from anywhere, on the gateway's port only
                assert [p["port"] for p in rule["ports"]] == [8000]
                continue
            assert sources, f"{name}: a rule open to every source"
            for source in sources:
                in_namespace = "namespaceSelector" not in source
                from_monitoring = source.get("namespaceSelector") == {
                    "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
                assert in_namespace or from_monitoring, f"{name}: opened to {source}"


def test_redis_is_reachable_from_conveyor_pods_only():
    [rule] = _ingress_rules(_pod_labels("StatefulSet", "redis"))
    assert rule["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/part-of": "conveyor"}}}]
    assert [p["port"] for p in rule["ports"]] == [6379]
    for name in CONVEYOR:
        assert _pod_labels("Deployment", name)["app.kubernetes.io/part-of"] == "conveyor"


def test_engine_metrics_are_open_to_the_monitoring_namespace():
    metrics_port = int(m.container_env("cpu", "engine")["CONVEYOR_ENGINE_METRICS_PORT"])
    opened = [p["port"] for rule in _ingress_rules(_pod_labels("Deployment", "engine"))
              if "namespaceSelector" in rule["from"][0] for p in rule["ports"]]
    assert opened == [metrics_port]


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_pods_run_as_non_root_on_a_read_only_root(overlay):
    for kind, name in [*(("Deployment", d["metadata"]["name"])
                         for d in m.objects(overlay, "Deployment")), ("StatefulSet", "redis")]:
        pod = m.pod_spec(overlay, name, kind)
        volumes = {v["name"] for v in pod.get("volumes", [])}
        volumes |= {t["metadata"]["name"] for t in
                    m.find(overlay, kind, name)["spec"].get("volumeClaimTemplates", [])}
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] > 0, name
        for c in pod["containers"]:
            security = c["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["capabilities"]["drop"] == ["ALL"], name
            assert {v["name"] for v in c.get("volumeMounts", [])} <= volumes, name


def test_engine_replicas_share_one_model_cache_and_name_their_writable_folders():
    pod = m.pod_spec("cpu", "engine")
    volumes = {v["name"]: v for v in pod["volumes"]}
    claim = volumes["model-cache"]["persistentVolumeClaim"]["claimName"]
    assert m.find("cpu", "PersistentVolumeClaim", claim)["spec"]["accessModes"] == [
        "ReadWriteMany"]
    mounts = {v["name"]: v["mountPath"] for v in m.container("cpu", "engine")["volumeMounts"]}
    assert set(mounts) == {"model-cache", "compile-cache", "tmp"}
    dockerfile = (m.ROOT / "services" / "engine" / "Dockerfile").read_text()
    assert f"CONVEYOR_CACHE_DIR={mounts['model-cache']}" in dockerfile
    assert f"TRITON_CACHE_DIR={mounts['compile-cache']}/" in dockerfile


def test_only_the_gpu_overlay_asks_for_nvidia_gpus():
    gpu = m.container("gpu", "engine")["resources"]
    assert gpu["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in m.container("cpu", "engine")["resources"].get("limits", {})
    assert m.container_env("gpu", "engine")["CONVEYOR_ENGINE_DEVICE"] == "cuda"
    cpu_env = m.container_env("cpu", "engine")
    assert cpu_env["CONVEYOR_ENGINE_DEVICE"] == "cpu"
    assert (cpu_env["CONVEYOR_ENGINE_DTYPE"], cpu_env["CONVEYOR_ENGINE_ATTENTION_BACKEND"]) == (
        "auto", "auto"), "CPU nodes pick dtype and attention as `make run` does"
    for name in ("gateway", "tokenizer", "detok"):
        assert "nvidia.com/gpu" not in str(m.container("gpu", name)["resources"])


def test_gpu_engines_roll_without_a_surge_pod():
    """A surge pod would wait for a spare GPU while maxUnavailable 0 keeps the old one."""
    rolling = m.find("gpu", "Deployment", "engine")["spec"]["strategy"]["rollingUpdate"]
    assert rolling == {"maxSurge": 0, "maxUnavailable": 1}


@pytest.mark.parametrize("name", CONVEYOR)
def test_settings_come_from_config_maps_and_the_redis_url_from_a_secret(name):
    main = m.container("cpu", name)
    assert all("configMapRef" in source for source in main["envFrom"])
    literal = {e["name"] for e in main.get("env", []) if "value" in e}
    assert not any(k.endswith("REDIS_URL") for k in literal)
    for key, value in m.container_env("cpu", name).items():
        assert not (value or "").startswith("redis://"), f"{key}: a Redis URL outside the Secret"
    if name in ("gateway", "engine"):
        [redis] = [e for e in main["env"] if e["name"].endswith("_REDIS_URL")]
        ref = redis["valueFrom"]["secretKeyRef"]
        secret = next(s for s in m.objects("cpu", "Secret") if s["metadata"]["name"] == ref["name"])
        assert ref["key"] in secret["data"]


def test_grafana_dashboard_ships_as_a_file_and_a_config_map():
    dashboard_file = m.KUBERNETES / "base" / "grafana" / "conveyor.json"
    config_map = m.find("cpu", "ConfigMap", "grafana-dashboard-conveyor")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["data"]["conveyor.json"] == dashboard_file.read_text()


def test_dashboard_queries_only_metrics_the_services_export():
    import json

    from conveyor.engine.metrics import EngineMetrics
    from conveyor.gateway.observability import GatewayMetrics

    exported = (_metric_names(EngineMetrics("m", "e").registry)
                | _metric_names(GatewayMetrics().registry))
    dashboard = json.loads((m.KUBERNETES / "base" / "grafana" / "conveyor.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"\b(?:conveyor[:_]|vllm:)[\w:]+", e)}
    assert used and used <= exported, sorted(used - exported)
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("first token", "per output token", "running", "kv cache", "prefix",
                  "tokens per second", "429", "503"):
        assert topic in titles


SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                   "gauge": ("",)}


def _metric_names(registry) -> set[str]:
    """Every sample name the registry can expose (counters' _total, histograms' _bucket...),
    labelled families with no sample yet included."""
    return {family.name + suffix for family in registry.collect()
            for suffix in SAMPLE_SUFFIXES.get(family.type, ("",))}
