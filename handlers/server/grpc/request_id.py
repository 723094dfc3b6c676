"""Request ids over gRPC: a unary call is served under metadata `x-request-id`, else its
request's `id`, else a fresh id, so its log lines carry it as HTTP requests' do (and, with
traces on, under the caller's `traceparent` metadata). A streamed
call's requests each answer with their own `id`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from handlers.server.request_ids import bound, new_id
from handlers.server.tracing import TRACE_HEADERS


class RequestIdInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, trace_headers: bool = False) -> None:
        self.trace_headers = trace_headers  # keep the caller's trace context (traces are on)

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        metadata = dict(details.invocation_metadata or ())
        given = metadata.get("x-request-id")
        behavior = handler.unary_unary
        trace = {name: metadata[name] for name in TRACE_HEADERS
                 if self.trace_headers and name in metadata}

        async def with_id(request: Any, context: grpc.aio.ServicerContext) -> Any:
            request_id = new_id(given, getattr(request, "id", None))
            request_id.trace_headers = trace
            with bound(request_id):
                return await behavior(request, context)

        return handler._replace(unary_unary=with_id)
