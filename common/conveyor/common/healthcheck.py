"""Container health probe: `python -m conveyor.common.healthcheck HOST:PORT [SERVICE]`.

Exits 0 when the gRPC server's grpc.health.v1 reports SERVING, 1 otherwise.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str = "", timeout_s: float = 3.0) -> bool:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print("usage: python -m conveyor.common.healthcheck HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    return 0 if check(*argv) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
