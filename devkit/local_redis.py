"""The Redis of the tests, the benchmarks and `make run` on this machine: its URL, starting
one where none answers, and deleting one run's keys.

`make redis` (scripts/ensure_redis.py) and the benchmarks start one when they must; the
tests never do: they require a running one and say how to start it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from urllib.parse import urlparse

DEFAULT_URL = "redis://127.0.0.1:6379/0"


def redis_url() -> str:
    """CONVEYOR_REDIS_URL, else the default (127.0.0.1:6379, database 0)."""
    return os.environ.get("CONVEYOR_REDIS_URL", DEFAULT_URL)


def ensure_redis(url: str | None = None) -> str:
    """Make sure a Redis answers at `url`'s host and port (default `redis_url()`): use a
    running one, else start `redis-server` there keeping nothing on disk (installing
    Debian's package first when it is missing and we are root with apt-get). Returns what
    it did; raises RuntimeError with advice when it cannot."""
    host, port = _address(url or redis_url())
    if redis_answers(host, port):
        return f"redis: using the one running at {host}:{port}"
    _start_redis(host, port)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if redis_answers(host, port):
            return f"redis: started at {host}:{port}"
        time.sleep(0.1)
    raise RuntimeError(f"redis: started but does not answer at {host}:{port}")


def redis_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def delete_namespace(url: str, prefix: str) -> None:
    """Delete every key under `prefix:` (a run's own namespace, at its end)."""
    from redis import Redis

    client = Redis.from_url(url, socket_timeout=2)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def _address(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname or "127.0.0.1", parsed.port or 6379


def _start_redis(host: str, port: int) -> None:
    if not shutil.which("redis-server"):
        _install_redis()
    subprocess.run(
        ["redis-server", "--daemonize", "yes", "--bind", host, "--port", str(port),
         "--save", "", "--appendonly", "no", "--dir", "/tmp"],
        check=True,
    )


def _install_redis() -> None:
    if not (shutil.which("apt-get") and os.geteuid() == 0):
        raise RuntimeError("redis-server not found: install Redis (e.g. `apt-get install "
                           "redis-server`) or point CONVEYOR_REDIS_URL at a running one")
    print("redis-server not found; installing Debian's redis-server package", flush=True)
    subprocess.run(["apt-get", "update", "-qq"], check=False)
    subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], check=True)
