"""The images compose and the Dockerfiles name, pulled, or stand-ins where no registry answers.

- python:3.11-slim, the Dockerfiles' base: a Debian bookworm root file system made by
  debootstrap (needs root), imported under that name with the label conveyor.standin, so
  `FROM python:3.11-slim` finds it. Its /etc/pip.conf names the indexes and wheel folders this
  machine's pip uses (mounted read-only into builds: `build_mounts`) and PyPI, and it carries
  the host's CA bundle.
- redis:7-alpine: Debian's redis-server on that base (redis.Containerfile).
- jaegertracing/jaeger:2.x: nothing else is Jaeger; otlp_receiver.py receives OTLP/gRPC and
  answers the part of Jaeger's query API the check reads.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
LOGS = ROOT / ".run-logs" / "compose-check"
PYTHON_BASE = "docker.io/library/python:3.11-slim"
STANDIN_LABEL = "conveyor.standin"
DEBIAN_PACKAGES = ("python3,python3-pip,python3-venv,python3.11-dev,python-is-python3,"
                   "ca-certificates")
PIP_KEYS = ("index-url", "extra-index-url", "find-links", "trusted-host", "cert")


@dataclass(frozen=True)
class Image:
    """What a compose service runs: `reference`, and how it was obtained."""

    reference: str
    origin: str  # "local", "pulled", or what stands in for it
    command: list[str] | None = None  # replaces the compose command (stand-ins only)

    @property
    def is_standin(self) -> bool:
        return self.origin not in ("local", "pulled")


def qualified(name: str) -> str:
    """A registry-qualified reference: redis:7-alpine -> docker.io/library/redis:7-alpine."""
    first = name.split("/")[0]
    if "/" in name and ("." in first or ":" in first or first == "localhost"):
        return name
    return f"docker.io/{name}" if "/" in name else f"docker.io/library/{name}"


def _exists(engine: str, reference: str) -> bool:
    inspect = subprocess.run([engine, "image", "inspect", reference], capture_output=True)
    return inspect.returncode == 0


def _pull(engine: str, reference: str) -> bool:
    return subprocess.run([engine, "pull", "-q", reference], capture_output=True).returncode == 0


def _labels(engine: str, reference: str) -> dict:
    out = subprocess.run([engine, "image", "inspect", "--format", "{{json .Config.Labels}}",
                          reference], capture_output=True, text=True, check=True).stdout
    return json.loads(out) or {}


def _local_or_pulled(engine: str, reference: str) -> Image | None:
    if _exists(engine, reference):
        standin = _labels(engine, reference).get(STANDIN_LABEL)
        return Image(reference, standin or "local")
    return Image(reference, "pulled") if _pull(engine, reference) else None


def python_base(engine: str) -> Image:
    return _local_or_pulled(engine, PYTHON_BASE) or _debootstrap_base(engine)


def redis(engine: str, name: str) -> Image:
    return _local_or_pulled(engine, qualified(name)) or _build(
        engine, "redis", "Debian's redis-server")


def jaeger(engine: str, name: str) -> Image:
    receiver = ["python", "/receiver/otlp_receiver.py"]
    return _local_or_pulled(engine, qualified(name)) or _build(
        engine, "otlp-receiver", "an OTLP receiver, not Jaeger", receiver)


def _build(engine: str, name: str, origin: str, command: list[str] | None = None) -> Image:
    reference = f"localhost/conveyor-check/{name}"
    with open(LOGS / f"build-{name}.log", "w") as log:
        subprocess.run([engine, "build", *build_options(engine), "-t", reference,
                        "-f", str(HERE / f"{name}.Containerfile"), str(ROOT)], check=True,
                       stdout=log, stderr=subprocess.STDOUT)
    return Image(reference, origin, command)


def build_options(engine: str) -> list[str]:
    """podman: the host's network, and the local pip folders a stand-in base's pip.conf names."""
    if engine != "podman":
        return []
    mounts = [f"--volume={path}:{path}:ro" for path in sorted(_pip_folders())]
    return ["--network=host", *mounts]


def _pip_settings() -> dict[str, str]:
    """This machine's pip index settings (`pip config list`: files, then PIP_* variables)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True).stdout
    settings = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        name = key.split(".", 1)[-1]
        if name in PIP_KEYS:
            settings[name] = value.strip("'\"")
    return settings


def _pip_folders() -> set[str]:
    """Local folders the pip settings name: wheel folders, and a file:// index's parent
    (its pages link to ../../files)."""
    settings = _pip_settings()
    folders = set()
    for value in (settings.get(k, "") for k in ("index-url", "extra-index-url", "find-links")):
        for location in value.split():
            url = urlparse(location)
            if url.scheme == "file":
                folders.add(str(Path(url.path).parent))
            elif not url.scheme and Path(location).is_dir():
                folders.add(location)
    return {f for f in folders if Path(f).is_dir()}


def _pip_conf() -> str:
    settings = _pip_settings()
    index = settings.get("index-url", "https://pypi.org/simple")
    # A Dockerfile's --index-url replaces only the index: PyPI stays reachable as an extra one.
    settings["extra-index-url"] = " ".join([index, *settings.get("extra-index-url", "").split()])
    return "[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items())


def _debootstrap_base(engine: str) -> Image:
    if not shutil.which("debootstrap"):
        raise RuntimeError(f"{PYTHON_BASE} cannot be pulled and debootstrap is missing "
                           "(scripts/compose_check/setup_podman.sh installs it)")
    print(f"  {PYTHON_BASE} cannot be pulled: making it with debootstrap (minutes)")
    with (tempfile.TemporaryDirectory(prefix="conveyor-rootfs-") as tmp,
          open(LOGS / "debootstrap.log", "w") as log):
        rootfs = Path(tmp) / "rootfs"
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={DEBIAN_PACKAGES}",
                        "bookworm", str(rootfs), "http://deb.debian.org/debian"], check=True,
                       stdout=log, stderr=subprocess.STDOUT)
        # pip installs system-wide, as in the official image.
        (rootfs / "usr/lib/python3.11/EXTERNALLY-MANAGED").unlink(missing_ok=True)
        (rootfs / "etc/pip.conf").write_text(_pip_conf())
        cert = _pip_settings().get("cert", "/etc/ssl/certs/ca-certificates.crt")
        if Path(cert).is_file():
            shutil.copyfile(cert, rootfs / cert.lstrip("/"))
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."],
                               stdout=subprocess.PIPE)
        subprocess.run([engine, "import",
                        "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"
                                    ":/sbin:/bin",
                        "--change", "ENV LANG=C.UTF-8", "--change", 'CMD ["python3"]',
                        "--change", f"LABEL {STANDIN_LABEL}=debootstrap",
                        "-", PYTHON_BASE], stdin=tar.stdout, check=True, stdout=log,
                       stderr=subprocess.STDOUT)
        tar.wait()
    return Image(PYTHON_BASE, "debootstrap")
