"""Reading request bodies: size limit, JSON decoding within bounds, request ids.
Protocol-neutral.

Errors are `BodyError`s; each protocol renders them in its own error shape.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from handlers.protocols.errors import ErrorKind
from handlers.server.http.json_limits import MAX_CONTAINERS, MAX_DEPTH, container_count, too_deep
from handlers.server.request_ids import current


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


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing (413) one over `limit` bytes without reading all of it: at once
    when its Content-Length says so, else as soon as what arrived passes the limit."""
    too_large = BodyError(f"request body is larger than the limit of {limit} bytes",
                          ErrorKind.TOO_LARGE)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
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


async def read_json(request: Request, limit: int) -> Any:
    """The decoded JSON body."""
    return decode_json(await read_body(request, limit))
