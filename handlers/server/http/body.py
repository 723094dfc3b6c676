"""Reading request bodies: framing, pace and size limits, JSON decoding within bounds, request
ids. Protocol-neutral.

Errors are `BodyError`s; each protocol renders them in its own error shape. A client that goes
away while sending its body is `ClientGone`.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import orjson
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from handlers.protocols.errors import ErrorKind
from handlers.server.generation import ClientGone
from handlers.server.http.json_limits import MAX_CONTAINERS, MAX_DEPTH, container_count, too_deep
from handlers.server.request_ids import current

log = logging.getLogger(__name__)


class BodyError(Exception):
    def __init__(self, message: str, kind: ErrorKind) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind


def adopt_request_id(protocol_id: str | None) -> None:
    """The body's own id becomes the request's (logs, `X-Request-Id`) unless a header named
    one."""
    bound_id = current()
    if bound_id is not None:
        bound_id.adopt(protocol_id)


class BodyTimeout(Exception):
    """The body paused longer than client_body_timeout (raised by the ASGI receive)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the request body stopped arriving: nothing came for {seconds:g} s "
                         "(client_body_timeout)")


class BodyFramingMiddleware:
    """What every request's body must be, before any route reads it: framed one way only
    (Content-Length with Transfer-Encoding is refused, 400, as RFC 9112 6.3 lets a server), and
    never paused longer than `timeout` seconds (`BodyTimeout` from `receive`, which the reader
    answers 408). Once the body ended, `receive` waits for a disconnect as long as it takes."""

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if "transfer-encoding" in headers and "content-length" in headers:
            log.info("refused a request framed by both Content-Length and Transfer-Encoding")
            refusal = PlainTextResponse("Content-Length and Transfer-Encoding together are "
                                        "refused (RFC 9112 6.3)", 400, {"Connection": "close"})
            await refusal(scope, receive, send)
            return
        body_ended = False

        async def receive_in_time() -> Message:
            nonlocal body_ended
            if body_ended:
                return await receive()
            try:
                with anyio.fail_after(self.timeout):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout(self.timeout) from None
            body_ended = not message.get("more_body", False)
            return message

        await self.app(scope, receive_in_time, send)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing (413) one over `limit` bytes without reading all of it: at once
    when its Content-Length says so, else as soon as what arrived passes the limit. One that
    stopped arriving is refused (408, and the connection closes); ClientGone when the client
    went away."""
    too_large = BodyError(f"request body is larger than the limit of {limit} bytes",
                          ErrorKind.TOO_LARGE)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except BodyTimeout as exc:
        raise BodyError(str(exc), ErrorKind.SLOW_BODY) from None
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)


def decode_json(raw: bytes, not_json: str = "request body is not valid JSON") -> Any:
    """`raw` decoded; refused (400) when it is not JSON (`not_json` says so), holds too many
    objects and arrays (counted before decoding them) or nests too deeply."""
    containers = container_count(raw)
    if containers > MAX_CONTAINERS:
        raise BodyError(f"the JSON body holds more than {MAX_CONTAINERS} objects and arrays",
                        ErrorKind.VALIDATION)
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BodyError(f"{not_json}: {_why(raw, exc)}", ErrorKind.VALIDATION) from None
    if containers > MAX_DEPTH and too_deep(value):  # fewer containers cannot nest that deep
        raise BodyError(f"the JSON body nests deeper than {MAX_DEPTH} levels",
                        ErrorKind.VALIDATION)
    return value


def _why(raw: bytes, exc: orjson.JSONDecodeError) -> str:
    """orjson's reason, or where the body stops being UTF-8 (orjson says "surrogates not
    allowed" of any invalid byte)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        return (f"it is not UTF-8 from byte {bad.start} on ({raw[bad.start]:#04x}: "
                f"{bad.reason})")
    return str(exc)
