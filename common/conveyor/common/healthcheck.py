"""Container health probe: `python -m conveyor.common.healthcheck TARGET [SERVICE]`.

TARGET is either a gRPC HOST:PORT (exits 0 when its grpc.health.v1 reports SERVING
for SERVICE, "" by default) or an http:// URL such as the gateway's
`http://127.0.0.1:8000/ready` (exits 0 on a 2xx answer). Exits 1 otherwise.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str = "", timeout_s: float = 3.0) -> bool:
    if target.startswith(("http://", "https://")):
        return check_http(target, timeout_s)
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def check_http(url: str, timeout_s: float = 3.0) -> bool:
    """True when GET url answers 2xx within timeout_s."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError):
        return False


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print("usage: python -m conveyor.common.healthcheck HOST:PORT|URL [SERVICE]",
              file=sys.stderr)
        return 2
    return 0 if check(*argv) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
