"""Counts each gRPC call, once it ends, in `lmi_requests_total` with protocol "kserve_v2_grpc",
the method's full name as the route and the status code's name as the status (as HTTP
requests are counted by the app's middleware)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from handlers.server.telemetry import GRPC_PROTOCOL, Telemetry


class CountingInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:  # a method the service lacks: gRPC answers UNIMPLEMENTED itself
            return None
        method = details.method
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(method, handler.unary_unary))
        if handler.stream_stream is not None:
            return handler._replace(stream_stream=self._streamed(method, handler.stream_stream))
        return handler  # the service has no other kind

    def _unary(self, method: str, behavior: Any) -> Any:
        async def counted(request: Any, context: Any) -> Any:
            failure: BaseException | None = None
            try:
                return await behavior(request, context)
            except BaseException as exc:
                failure = exc
                raise
            finally:
                self._count(method, context, failure)
        return counted

    def _streamed(self, method: str, behavior: Any) -> Any:
        async def counted(requests: Any, context: Any) -> AsyncIterator[Any]:
            failure: BaseException | None = None
            try:
                async for response in behavior(requests, context):
                    yield response
            except BaseException as exc:
                failure = exc
                raise
            finally:
                self._count(method, context, failure)
        return counted

    def _count(self, method: str, context: Any, failure: BaseException | None) -> None:
        self.telemetry.answered(GRPC_PROTOCOL, method, _status(context, failure))


def _status(context: Any, failure: BaseException | None) -> str:
    """The code the call ended with: the one the servicer set (context.abort sets it), else
    what grpc answers for how the behaviour ended."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(failure, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED.name
    if failure is not None:
        return grpc.StatusCode.UNKNOWN.name
    return grpc.StatusCode.OK.name
