"""Reading the deployment files the way their tools do, for the tests that check them:
the compose files (parsed: no compose plugin here) and the Kustomize overlays (rendered
offline by `kubectl kustomize`)."""

from __future__ import annotations

import functools
import importlib
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu")
KUBERNETES_VERSION = "1.32"
"""The Kubernetes schemas the manifests are validated against (kubernetes-validate)."""

SETTINGS_CLASSES = {
    "tokenizer": ("conveyor.tokenizer.settings", "TokenizerSettings"),
    "engine": ("conveyor.engine.settings", "EngineSettings"),
    "detok": ("conveyor.detok.settings", "DetokSettings"),
    "gateway": ("conveyor.gateway.settings", "GatewaySettings"),
}
GRPC_SERVICES = ("tokenizer", "engine", "detok")
WORKER_SETTINGS = {"batch": ("conveyor.batch.settings", "BatchSettings")}
"""Processes that listen on no port (the Celery batch worker)."""


def settings_class(service: str) -> type:
    module, name = {**SETTINGS_CLASSES, **WORKER_SETTINGS}[service]
    return getattr(importlib.import_module(module), name)


def setting_names(service: str) -> set[str]:
    """Every environment variable the service's settings class reads."""
    return {variable for variable, _, _ in settings_class(service).describe()}


def settings_from(service: str, env: dict[str, str]) -> object:
    """The service's settings as the process would read them from `env` (CONVEYOR_* only)."""
    cls = settings_class(service)
    prefix = cls.model_config["env_prefix"]
    fields = {key[len(prefix):].lower(): value for key, value in env.items()
              if key.startswith(prefix) and value is not None}
    return cls(**fields)


class _ComposeLoader(yaml.SafeLoader):
    """YAML loader that accepts compose's `!reset` tag."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def load_compose(name: str = "docker-compose.yml") -> dict:
    return yaml.load((ROOT / name).read_text(), Loader=_ComposeLoader)


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    """The overlay's objects, as `kubectl kustomize` renders them."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise RuntimeError("kubectl is needed to render deploy/kubernetes (kubectl kustomize)")
    result = subprocess.run([kubectl, "kustomize", str(KUBERNETES / "overlays" / overlay)],
                            capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"kubectl kustomize overlays/{overlay} failed:\n{result.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def objects(overlay: str, kind: str) -> list[dict]:
    return [o for o in render(overlay) if o["kind"] == kind]


def find(overlay: str, kind: str, name: str) -> dict:
    """The one object of that kind named `name`; a generated ConfigMap or Secret may carry
    kustomize's hash suffix (`name-<hash>`)."""
    found = [o for o in objects(overlay, kind) if _is_named(o, name)]
    assert len(found) == 1, f"{kind}/{name}: found {len(found)} in overlays/{overlay}"
    return found[0]


def _is_named(obj: dict, name: str) -> bool:
    actual = obj["metadata"]["name"]
    generated = obj["kind"] in ("ConfigMap", "Secret")
    return actual == name or (generated and actual.rsplit("-", 1)[0] == name)


def container(overlay: str, workload: str, kind: str = "Deployment") -> dict:
    """The main container of a workload (named like it)."""
    spec = find(overlay, kind, workload)["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] if c["name"] == workload)


def pod_spec(overlay: str, workload: str, kind: str = "Deployment") -> dict:
    return find(overlay, kind, workload)["spec"]["template"]["spec"]


def container_env(overlay: str, workload: str) -> dict[str, str | None]:
    """The container's environment: its ConfigMaps' data, then its own `env` entries
    (a value from a Secret or the downward API as None)."""
    main = container(overlay, workload)
    env: dict[str, str | None] = {}
    for source in main.get("envFrom", []):
        name = source["configMapRef"]["name"]
        data = next(o for o in objects(overlay, "ConfigMap") if o["metadata"]["name"] == name)
        env.update(data.get("data", {}))
    for entry in main.get("env", []):
        env[entry["name"]] = entry.get("value")
    return env


def port_number(main: dict, port: int | str) -> int:
    """A probe's or Service's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in main["ports"] if p.get("name") == port)


def matches(selector: dict, labels: dict) -> bool:
    """matchLabels and matchExpressions (In) against an object's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", f"unsupported operator in {expr}"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True
