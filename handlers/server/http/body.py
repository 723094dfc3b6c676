"""Reading request bodies: size limit, JSON decoding, request ids. Protocol-neutral.

Errors are `BodyError`s; each protocol renders them in its own error shape.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson
from starlette.requests import Request

from handlers.protocols.errors import ErrorKind

REQUEST_ID_HEADER = "X-Amzn-SageMaker-Inference-Id"


class BodyError(Exception):
    def __init__(self, message: str, kind: ErrorKind) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind


def request_id(request: Request) -> str:
    """SageMaker's inference id when the caller sent one, else a fresh id (for logs)."""
    return request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing (413) one over `limit` bytes without reading all of it."""
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


async def read_json(request: Request, limit: int) -> Any:
    """The decoded JSON body."""
    raw = await read_body(request, limit)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BodyError(f"request body is not valid JSON: {exc}", ErrorKind.VALIDATION) from None
