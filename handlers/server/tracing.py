"""OpenTelemetry traces of generation requests, exported over OTLP as vLLM exports them: one
`llm_request` span (kind SERVER) per client request with vLLM's `gen_ai.*` attributes, under
the caller's W3C `traceparent`/`tracestate`, and child spans for admission (validation and the
admission limit), prefill (submission to first token) and the stream (first token to last).

Off unless `option.otlp_traces_endpoint` (`--otlp-traces-endpoint`, or the standard
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set: then, and only then, the OpenTelemetry SDK is
imported and an exporter made; off, a request carries no trace object at all. The exporter's
other settings (headers, timeout, compression, certificates, the sampler, the service name) are
the SDK's own `OTEL_*` variables; the wire is `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (or
`OTEL_EXPORTER_OTLP_PROTOCOL`): grpc (vLLM's default) or http/protobuf.

Spans are cheap: the root opens when the driver takes the request (so its trace id is in the
request's log lines from then on) and everything else is written once, when it ends, from
the times the request's telemetry already keeps; nothing happens per token.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from handlers.config.values import otlp_protocol
from handlers.engine.types import GenerationRequest

TRACE_HEADERS = ("traceparent", "tracestate")
SERVICE_NAME = "lmi-serve"


class Tracing:
    """The tracer provider and its OTLP exporter, made once per server."""

    def __init__(self, endpoint: str, env: Mapping[str, str] = os.environ) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.endpoint, self.protocol = endpoint, otlp_protocol(env)
        named = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME}
        self._provider = TracerProvider(resource=Resource.create(named))
        self._provider.add_span_processor(BatchSpanProcessor(self._exporter()))
        self.tracer = self._provider.get_tracer("handlers.server")
        self._propagator = TraceContextTextMapPropagator()

    def _exporter(self) -> Any:
        if self.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,  # type: ignore[assignment]
            )
        return OTLPSpanExporter(endpoint=self.endpoint)

    def begin(self, headers: Mapping[str, str], model: str, request_id: str, arrival: float
              ) -> RequestTrace:
        """The root span of one client request that arrived at `arrival` (monotonic), a child
        of the caller's trace if it sent one."""
        return RequestTrace(self, self._propagator.extract(dict(headers)), model, request_id,
                            arrival)

    def shutdown(self) -> None:
        """Export what is still queued and stop the exporter."""
        self._provider.shutdown()


class RequestTrace:
    """One client request's spans: the root now, the children once it ends."""

    def __init__(self, tracing: Tracing, parent: Any, model: str, request_id: str,
                 arrival: float) -> None:
        from opentelemetry.trace import SpanKind

        self._tracer = tracing.tracer
        # The driver's times are monotonic; spans' are the wall clock's.
        self._wall, self._mono = time.time_ns(), time.monotonic()
        self._arrival = arrival
        self._admitted: float | None = None
        self.span = self._tracer.start_span("llm_request", context=parent, kind=SpanKind.SERVER,
                                            start_time=self._ns(arrival))
        self.span.set_attributes({"gen_ai.response.model": model,
                                  "gen_ai.request.id": request_id})
        self.trace_id = format(self.span.get_span_context().trace_id, "032x")

    def admitted(self, requests: Sequence[GenerationRequest]) -> None:
        """The requests passed validation and admission; their settings are the span's."""
        self._admitted = time.monotonic()
        params = requests[0].params
        self.span.set_attributes({
            "gen_ai.request.max_tokens": params.max_new_tokens,
            "gen_ai.request.temperature": params.temperature if params.do_sample else 0.0,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.n": params.n,
        })
        self._child("admission", self._arrival, self._admitted)

    def ended(self, usage: Usage, error: str | None = None) -> None:
        """Close every span: usage and latencies as the request's telemetry observed them."""
        from opentelemetry.trace import Status, StatusCode

        now = time.monotonic()
        start = self._admitted or now
        if self._admitted is not None:
            self._child("prefill", start, usage.first_token or now)
            if usage.first_token is not None:
                self._child("stream", usage.first_token, usage.last_output or now)
        self.span.set_attributes(usage.attributes(self._arrival, now))
        if error is not None:
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end(end_time=self._ns(now))

    def _child(self, name: str, start: float, end: float) -> None:
        from opentelemetry.trace import set_span_in_context

        span = self._tracer.start_span(name, context=set_span_in_context(self.span),
                                       start_time=self._ns(start))
        span.end(end_time=self._ns(max(start, end)))

    def _ns(self, monotonic: float) -> int:
        return self._wall + int((monotonic - self._mono) * 1e9)


@dataclass(frozen=True)
class Usage:
    """What the traces report of a client request's engine requests, summed as the protocols'
    `usage` objects sum them: prompt tokens of each engine request, tokens of every sequence."""

    prompt_tokens: int
    completion_tokens: int
    sequences: int
    queue_time: float  # seconds, the longest of its engine requests'
    first_token: float | None  # monotonic time of the first token, if any came
    last_output: float | None

    def attributes(self, start: float, end: float) -> dict[str, Any]:
        found = {
            # vLLM's names, and the current semantic conventions' for the same counts
            "gen_ai.usage.prompt_tokens": self.prompt_tokens,
            "gen_ai.usage.completion_tokens": self.completion_tokens,
            "gen_ai.usage.input_tokens": self.prompt_tokens,
            "gen_ai.usage.output_tokens": self.completion_tokens,
            "gen_ai.usage.num_sequences": self.sequences,
            "gen_ai.latency.time_in_queue": self.queue_time,
            "gen_ai.latency.e2e": end - start,
        }
        if self.first_token is not None:
            found["gen_ai.latency.time_to_first_token"] = self.first_token - start
        return found


NO_USAGE = Usage(0, 0, 0, 0.0, None, None)  # a request refused before the engine saw it
