"""The SageMaker runtime API, emulated: boto3's `sagemaker-runtime` client can call this server.

Both routes answer as the container's own `/invocations` does, as SageMaker forwards them; the
endpoint name is ignored (one server, one model). A container error becomes SageMaker's
`ModelError` (424); a streamed answer goes out as AWS event-stream `PayloadPart`s, one per chunk,
and a stream that fails after it began ends with a `ModelStreamError`. Header names follow
botocore's service model.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import anyio
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from handlers.protocols.sagemaker_eventstream import EVENT_STREAM, model_stream_error, payload_part
from handlers.protocols.schemas.sagemaker import ModelError
from handlers.server.context import ServerContext
from handlers.server.framing import Reply, StreamReply
from handlers.server.http.answers import (
    ClosingStreamingResponse,
    content_type,
    json_response,
    to_response,
)
from handlers.server.http.descriptor import CUSTOM_ATTRIBUTES, STRING, Doc, Protocol
from handlers.server.http.invocations import Invocations

log = logging.getLogger(__name__)

STREAM_CONTENT_TYPE = "X-Amzn-SageMaker-Content-Type"
ERROR_TYPE = "x-amzn-errortype"  # botocore's rest-json error code


def protocol(entry: Invocations) -> Protocol:
    body = entry.doc("")
    return Protocol(lambda ctx: _router(ctx, entry), {
        ("post", "/endpoints/{name}/invocations"): Doc(
            "SageMaker runtime InvokeEndpoint, emulated", body.request, body.ok,
            {424: ModelError}),
        ("post", "/endpoints/{name}/invocations-response-stream"): Doc(
            "SageMaker runtime InvokeEndpointWithResponseStream, emulated (AWS event-stream "
            "PayloadParts)", body.request, {EVENT_STREAM: STRING}, {424: ModelError}),
    })


def _router(ctx: ServerContext, entry: Invocations) -> APIRouter:
    routes = APIRouter()

    @routes.post("/endpoints/{name}/invocations")
    async def invoke_endpoint(name: str, request: Request) -> Response:
        answer = await entry.invoke(ctx, request)
        if isinstance(answer, Reply) and answer.status >= 400:
            return _echo_attributes(request, _model_error(answer))
        return _echo_attributes(request, to_response(answer))

    @routes.post("/endpoints/{name}/invocations-response-stream")
    async def invoke_endpoint_with_response_stream(name: str, request: Request) -> Response:
        answer = await entry.invoke(ctx, request)
        if isinstance(answer, Reply) and answer.status >= 400:
            return _echo_attributes(request, _model_error(answer))
        events = _event_stream(answer)
        stream = ClosingStreamingResponse(events, media_type=EVENT_STREAM)
        media_type = answer.framing.media_type if isinstance(answer, StreamReply) \
            else answer.media_type
        stream.headers[STREAM_CONTENT_TYPE] = content_type(media_type)
        return _echo_attributes(request, stream)

    return routes


def _echo_attributes(request: Request, response: Response) -> Response:
    attributes = request.headers.get(CUSTOM_ATTRIBUTES)
    if attributes is not None:
        response.headers[CUSTOM_ATTRIBUTES] = attributes
    return response


def _model_error(reply: Reply) -> Response:
    """What SageMaker answers when the container answers an error: the original status and
    body ride along in `OriginalStatusCode` and `OriginalMessage`."""
    original = reply.body.decode(errors="replace")
    kind = "client" if reply.status < 500 else "server"
    body = {
        "ErrorCode": f"{kind.upper()}_ERROR_FROM_MODEL",
        "Message": f'Received {kind} error ({reply.status}) from model with message '
                   f'"{original}".',
        "OriginalStatusCode": reply.status,
        "OriginalMessage": original,
    }
    return json_response(Reply(424, body, {ERROR_TYPE: "ModelError"}))


async def _event_stream(answer: Reply | StreamReply) -> AsyncIterator[bytes]:
    """Each chunk as a PayloadPart; the event that fails a stream as a ModelStreamError."""
    if isinstance(answer, Reply):
        yield payload_part(answer.body)
        return
    try:
        async for events in answer.chunks:
            failed = next((i for i, event in enumerate(events) if event.failure), None)
            if data := answer.encode(events[:failed]):
                yield payload_part(data)
            if failed is not None:
                log.info("model stream failed: %s", events[failed].failure)
                yield model_stream_error(events[failed].failure)
                return
        if answer.framing.trailer is not None:
            yield payload_part(answer.framing.trailer)
    except Exception as exc:
        log.exception("model stream failed")
        yield model_stream_error(str(exc) or type(exc).__name__)
    finally:
        with anyio.CancelScope(shield=True):
            await answer.chunks.aclose()
