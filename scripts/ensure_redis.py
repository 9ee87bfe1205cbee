"""Make sure a Redis answers at CONVEYOR_REDIS_URL's host and port (default 127.0.0.1:6379).

Uses a running Redis when there is one; otherwise starts `redis-server` (installing
Debian's package first when it is missing and we are root with apt-get), keeping
nothing on disk. Prints what it did; exits non-zero with advice when it cannot.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse


def _address() -> tuple[str, int]:
    url = urlparse(os.environ.get("CONVEYOR_REDIS_URL", "redis://127.0.0.1:6379/0"))
    return url.hostname or "127.0.0.1", url.port or 6379


def redis_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _install_redis() -> None:
    if shutil.which("apt-get") and os.geteuid() == 0:
        print("redis-server not found; installing Debian's redis-server package")
        subprocess.run(["apt-get", "update", "-qq"], check=False)
        subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], check=True)
        return
    sys.exit("redis-server not found: install Redis (e.g. `apt-get install redis-server`) "
             "or point CONVEYOR_REDIS_URL at a running one")


def _start_redis(host: str, port: int) -> None:
    if not shutil.which("redis-server"):
        _install_redis()
    subprocess.run(
        ["redis-server", "--daemonize", "yes", "--bind", host, "--port", str(port),
         "--save", "", "--appendonly", "no", "--dir", "/tmp"],
        check=True,
    )


def main() -> int:
    host, port = _address()
    if redis_answers(host, port):
        print(f"redis: using the one running at {host}:{port}")
        return 0
    _start_redis(host, port)
    for _ in range(50):
        if redis_answers(host, port):
            print(f"redis: started at {host}:{port}")
            return 0
        time.sleep(0.1)
    print(f"redis: started but does not answer at {host}:{port}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
