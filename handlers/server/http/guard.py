"""Every HTTP route's answer to what stops it: a protocol's refusal, a client that went away,
a generation the driver stopped, a bug. Each protocol says how it answers (`HttpProtocol`)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from handlers.protocols.errors import REFUSALS, ErrorKind, GenerationError, ProtocolError
from handlers.server.framing import Answer, Reply, error_reply
from handlers.server.generation import ClientGone
from handlers.server.http.answers import GONE
from handlers.server.http.body import BodyError, decode_json, read_body
from handlers.server.status import Table

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpProtocol:
    """How one protocol answers over HTTP: its status table and its error objects."""

    name: str
    table: Table[ErrorKind, int]
    refusal: Callable[[str, ErrorKind], ProtocolError]  # an error of the protocol's own shape
    failure: Callable[[GenerationError], ProtocolError]  # a generation the driver stopped

    def error(self, message: str, kind: ErrorKind) -> Reply:
        return error_reply(self.refusal(message, kind), self.table)


async def read_then(protocol: HttpProtocol, request: Request, limit: int,
                    answer: Callable[[Any], Awaitable[Answer]],
                    decode: Callable[[bytes], Any] = decode_json) -> Answer:
    """Read the body (at most `limit` bytes), decode it (as JSON unless told otherwise), then
    answer it; a body that cannot be read is refused in the protocol's shape."""
    try:
        body = decode(await read_body(request, limit))
    except BodyError as exc:
        log.info("bad body: %s", exc.message)
        return protocol.error(exc.message, exc.kind)
    except ClientGone:
        log.info("client disconnected while sending the request body")
        return Reply(GONE, None)
    return await answer(body)


async def guarded(protocol: HttpProtocol, work: Callable[[], Awaitable[Answer]]
                  ) -> Answer:
    try:
        return await work()
    except ProtocolError as exc:
        log.info("%s request refused: %s", protocol.name, exc.message)
        return error_reply(exc, protocol.table)
    except ClientGone:
        log.info("client disconnected; request aborted")
        return Reply(GONE, None)
    except GenerationError as exc:
        if exc.kind in REFUSALS:
            log.info("%s request refused: %s", protocol.name, exc.message)
        else:
            log.warning("generation failed: %s", exc.message,
                        exc_info=exc.__cause__ if exc.crashed else None)
        return error_reply(protocol.failure(exc), protocol.table)
    except RecursionError:  # a body nested deeply enough for some walk over it to give up
        log.info("%s request refused: nested too deeply", protocol.name)
        return protocol.error("the request is nested too deeply", ErrorKind.VALIDATION)
    except Exception:
        log.exception("unexpected error")
        return protocol.error("internal server error", ErrorKind.INTERNAL)
