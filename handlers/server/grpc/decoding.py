"""Messages that do not parse are the client's error: INVALID_ARGUMENT, not UNKNOWN.

grpc runs a method's deserializer before the servicer, and answers UNKNOWN (an "unexpected"
exception) when it raises, which clients read as a server fault. So every deserializer here
answers an `Undecodable` instead: a unary call is refused with INVALID_ARGUMENT before its
servicer runs; a streamed one reaches the servicer, which answers it on the stream as it answers
any refused request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class Undecodable:
    """A request message that did not parse."""

    message: str
    id: str = ""  # what the servicer logs of a request

    @classmethod
    def of(cls, error: DecodeError) -> Undecodable:
        return cls(f"the request message does not parse: {error}")


def tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return Undecodable.of(exc)

    return parse


def _refusing(behavior: Callable[[Any, Any], Awaitable[Any]]
              ) -> Callable[[Any, Any], Awaitable[Any]]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)

    return unary


class DecodeGuard(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails
                                ) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        handler = handler._replace(request_deserializer=tolerant(handler.request_deserializer))
        if handler.unary_unary is not None:
            handler = handler._replace(unary_unary=_refusing(handler.unary_unary))
        return handler
