"""The API key over gRPC: metadata `authorization: Bearer <key>` or `x-api-key: <key>`; a call
without it ends UNAUTHENTICATED before its servicer runs. ServerLive and ServerReady, the
health RPCs, stay open (as /v2/health/live and /v2/health/ready do over HTTP)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from handlers.server.api_key import UNAUTHORIZED, ApiKey

_SERVICE = "/inference.GRPCInferenceService/"
OPEN_METHODS = frozenset({_SERVICE + "ServerLive", _SERVICE + "ServerReady"})


async def _refuse_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHORIZED)


async def _refuse_stream(requests: Any, context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[Any]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHORIZED)
    yield  # an async generator, as a stream-stream behaviour is


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, key: str) -> None:
        self.key = ApiKey(key)

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method in OPEN_METHODS or self._accepts(details):
            return handler
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_refuse_unary)
        if handler.stream_stream is not None:
            return handler._replace(stream_stream=_refuse_stream)
        return None  # no other kind in this service: UNIMPLEMENTED rather than unguarded

    def _accepts(self, details: grpc.HandlerCallDetails) -> bool:
        metadata = {key: value for key, value in details.invocation_metadata or ()
                    if isinstance(value, str)}
        return self.key.accepts(metadata.get("authorization"), metadata.get("x-api-key"))
