"""A stand-in for Jaeger where its image cannot be pulled (`make compose-check`).

Receives traces over OTLP/gRPC on 0.0.0.0:4317, as Jaeger does, keeps them in memory and
answers the part of Jaeger's query API (port 16686) that the check reads, in Jaeger's shape:
    GET /api/services               {"data": [service names]}
    GET /api/traces?service=NAME    {"data": [{"traceID", "spans": [{"operationName",
                                     "processID"}], "processes": {id: {"serviceName"}}}]}
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections import defaultdict
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class TraceStore:
    """Spans by trace id: (service name, span name) pairs."""

    def __init__(self):
        self._lock = threading.Lock()
        self._traces: dict[str, list[tuple[str, str]]] = defaultdict(list)

    def add(self, trace_id: str, service: str, name: str) -> None:
        with self._lock:
            self._traces[trace_id].append((service, name))

    def services(self) -> list[str]:
        with self._lock:
            return sorted({s for spans in self._traces.values() for s, _ in spans})

    def traces_of(self, service: str) -> list[dict]:
        with self._lock:
            found = {t: list(spans) for t, spans in self._traces.items()
                     if any(s == service for s, _ in spans)}
        return [{"traceID": trace_id,
                 "spans": [{"operationName": name, "processID": s} for s, name in spans],
                 "processes": {s: {"serviceName": s} for s, _ in spans}}
                for trace_id, spans in found.items()]


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, store: TraceStore):
        self._store = store

    def Export(self, request, context):  # noqa: N802 - the gRPC method's name
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "unknown")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self._store.add(span.trace_id.hex(), service, span.name)
        return trace_service_pb2.ExportTraceServiceResponse()


def query_handler(store: TraceStore) -> type[BaseHTTPRequestHandler]:
    class Query(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            url = urlparse(self.path)
            if url.path == "/api/services":
                self._send(200, {"data": store.services()})
            elif url.path == "/api/traces":
                service = parse_qs(url.query).get("service", [""])[0]
                self._send(200, {"data": store.traces_of(service)})
            else:
                self._send(404, {"errors": [{"msg": f"no {url.path} in this stand-in"}]})

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Query


def main() -> None:
    store = TraceStore()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(store), server)
    server.add_insecure_port("0.0.0.0:4317")
    server.start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # PID 1 in its container
    print("OTLP receiver (a stand-in for Jaeger): gRPC :4317, query API :16686", flush=True)
    ThreadingHTTPServer(("0.0.0.0", 16686), query_handler(store)).serve_forever()


if __name__ == "__main__":
    main()
