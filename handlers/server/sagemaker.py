"""The SageMaker runtime API, emulated: boto3's `sagemaker-runtime` client can call this server.

Both routes forward to the container's own `/invocations` logic, as SageMaker does; the endpoint
name is ignored (one server, one model). Header names follow botocore's service model.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

import anyio
import orjson
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from handlers.protocols.sagemaker import EVENT_STREAM, model_stream_error, payload_part
from handlers.server.body import request_id
from handlers.server.responses import json_response
from handlers.server.streaming import ClosingStreamingResponse

log = logging.getLogger(__name__)

Invoke = Callable[[Request], Awaitable[Response]]

CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
STREAM_ACCEPT = "X-Amzn-SageMaker-Accept"
STREAM_CONTENT_TYPE = "X-Amzn-SageMaker-Content-Type"
ERROR_TYPE = "x-amzn-errortype"  # botocore's rest-json error code


def add_sagemaker_routes(app: FastAPI, invoke: Invoke) -> None:
    @app.post("/endpoints/{name}/invocations")
    async def invoke_endpoint(name: str, request: Request) -> Response:
        response = await invoke(request)
        return _answer(request, response)

    @app.post("/endpoints/{name}/invocations-response-stream")
    async def invoke_endpoint_with_response_stream(name: str, request: Request) -> Response:
        response = await invoke(_with_accept(request, request.headers.get(STREAM_ACCEPT)))
        if response.status_code >= 400:
            return _answer(request, response)
        content_type = response.headers.get("content-type", "application/json")
        events = _event_stream(_chunks(response), request_id(request))
        stream = ClosingStreamingResponse(events, media_type=EVENT_STREAM)
        stream.headers[STREAM_CONTENT_TYPE] = content_type
        _echo_attributes(request, stream)
        return stream


def _answer(request: Request, response: Response) -> Response:
    """The container's answer, or SageMaker's `ModelError` (424) when the container failed."""
    if response.status_code >= 400:
        response = _model_error(response)
    _echo_attributes(request, response)
    return response


def _echo_attributes(request: Request, response: Response) -> None:
    attributes = request.headers.get(CUSTOM_ATTRIBUTES)
    if attributes is not None:
        response.headers[CUSTOM_ATTRIBUTES] = attributes


def _model_error(response: Response) -> Response:
    """What SageMaker answers when the container answers an error: the original status and
    body ride along in `OriginalStatusCode` and `OriginalMessage`."""
    status = response.status_code
    original = bytes(response.body).decode(errors="replace")
    kind = "client" if status < 500 else "server"
    body = {
        "ErrorCode": f"{kind.upper()}_ERROR_FROM_MODEL",
        "Message": f'Received {kind} error ({status}) from model with message "{original}".',
        "OriginalStatusCode": status,
        "OriginalMessage": original,
    }
    return json_response(body, 424, {ERROR_TYPE: "ModelError"})


def _with_accept(request: Request, accept: str | None) -> Request:
    """The request as the container sees it: SageMaker passes `X-Amzn-SageMaker-Accept` on as
    `Accept`."""
    if accept is None:
        return request
    headers = [(k, v) for k, v in request.scope["headers"] if k != b"accept"]
    headers.append((b"accept", accept.encode("latin-1")))
    return Request({**request.scope, "headers": headers}, request.receive)


async def _chunks(response: Response) -> AsyncGenerator[bytes, None]:
    if not isinstance(response, StreamingResponse):
        yield bytes(response.body)
        return
    body = response.body_iterator
    try:
        async for chunk in body:
            yield chunk.encode() if isinstance(chunk, str) else bytes(chunk)
    finally:
        close = getattr(body, "aclose", None)
        if close is not None:
            with anyio.CancelScope(shield=True):
                await close()


async def _event_stream(chunks: AsyncGenerator[bytes, None], rid: str) -> AsyncIterator[bytes]:
    """Each chunk as a PayloadPart; a failure after streaming began as a ModelStreamError."""
    try:
        async for chunk in chunks:
            sent, failure = _split_failure(chunk)
            if sent:
                yield payload_part(sent)
            if failure is not None:
                log.info("[RequestId=%s] model stream failed: %s", rid, failure)
                yield model_stream_error(failure)
                return
    except Exception as exc:
        log.exception("[RequestId=%s] model stream failed", rid)
        yield model_stream_error(str(exc) or type(exc).__name__)
    finally:
        with anyio.CancelScope(shield=True):
            await chunks.aclose()


def _split_failure(chunk: bytes) -> tuple[bytes, str | None]:
    """The chunk's lines before the LMI stream's error line, and that line's message if any."""
    lines = chunk.splitlines(keepends=True)
    for i, line in enumerate(lines):
        failure = _failure_message(line)
        if failure is not None:
            return b"".join(lines[:i]), failure
    return chunk, None


def _failure_message(line: bytes) -> str | None:
    """The LMI streams end a failed generation with a line whose `details.finish_reason` is
    "error" (seed 004), in jsonlines or as an SSE `data:` line; dynamic batching's stream with
    its handler-failure body `{"code", "message", "error"}`."""
    if b'"error"' not in line:
        return None
    text = line.strip().removeprefix(b"data:").strip()
    try:
        record = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(record, dict):
        return None
    details = record.get("details")
    failed = isinstance(details, dict) and details.get("finish_reason") == "error"
    if not failed and not ("code" in record and "message" in record and "error" in record):
        return None
    return str(record.get("error") or "the model's generation failed after streaming began")
