"""Request ids over gRPC: a unary call is served under metadata `x-request-id`, else its
request's `id`, else a fresh id, so its log lines carry it as HTTP requests' do. A streamed
call's requests each answer with their own `id`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from handlers.server.request_ids import bound, new_id


class RequestIdInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        given = dict(details.invocation_metadata or ()).get("x-request-id")
        behavior = handler.unary_unary

        async def with_id(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with bound(new_id(given, getattr(request, "id", None))):
                return await behavior(request, context)

        return handler._replace(unary_unary=with_id)
