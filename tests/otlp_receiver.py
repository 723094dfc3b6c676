"""Local OTLP trace receivers, as a collector would be: gRPC (OpenTelemetry's own
`TraceService` stubs) and HTTP/protobuf (`POST /v1/traces`), each decoding the
`ExportTraceServiceRequest`s it is sent into the spans a test reads."""

from __future__ import annotations

import contextlib
import http.server
import queue
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str  # 32 hex digits
    span_id: str
    parent_span_id: str  # "" for a root
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    start_ns: int
    end_ns: int
    service_name: str


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind is not None else None


def spans_of(request: Any) -> list[Span]:
    found = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                found.append(Span(span.name, span.trace_id.hex(), span.span_id.hex(),
                                  span.parent_span_id.hex(),
                                  {a.key: _value(a.value) for a in span.attributes},
                                  span.status.code, span.start_time_unix_nano,
                                  span.end_time_unix_nano, resource.get("service.name", "")))
    return found


class Receiver:
    """The spans received, in order of arrival."""

    def __init__(self) -> None:
        self.spans: queue.Queue[Span] = queue.Queue()
        self.endpoint = ""
        self._by_trace: dict[str, list[Span]] = {}

    def trace(self, trace_id: str, count: int, timeout: float = 60) -> dict[str, Span]:
        """The first `count` spans of one trace, by name, once they all arrived (the exporter
        sends in batches, a moment after each span ends)."""
        while len(self._by_trace.get(trace_id, ())) < count:
            span = self.spans.get(timeout=timeout)
            self._by_trace.setdefault(span.trace_id, []).append(span)
        return {span.name: span for span in self._by_trace[trace_id][:count]}

    def traces(self) -> dict[str, list[Span]]:
        """Every span received so far, by trace id."""
        while not self.spans.empty():
            span = self.spans.get_nowait()
            self._by_trace.setdefault(span.trace_id, []).append(span)
        return self._by_trace

    def received(self, request: Any) -> None:
        for span in spans_of(request):
            self.spans.put(span)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the proto's name
        self.receiver.received(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextlib.contextmanager
def grpc_receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(receiver), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    receiver.endpoint = f"http://127.0.0.1:{port}"
    try:
        yield receiver
    finally:
        server.stop(None)


@contextlib.contextmanager
def http_receiver() -> Iterator[Receiver]:
    receiver = Receiver()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            status = 404
            if self.path == "/v1/traces" and \
                    self.headers["Content-Type"] == "application/x-protobuf":
                receiver.received(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                status = 200
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    receiver.endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    try:
        yield receiver
    finally:
        server.shutdown()
