"""The one free-port helper of the tests, benchmarks and launchers."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port free now (the kernel's pick; another process may take it later, so
    a service that can bind port 0 and report it is better where it can)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
