"""Request ids over HTTP: a pure ASGI middleware (it never buffers a stream) that binds each
request's id for the logs and returns it in `X-Request-Id` on every response, streams
included, echoing SageMaker's `X-Amzn-SageMaker-Inference-Id` when the caller sent one. With
traces on it keeps the caller's `traceparent`/`tracestate` beside the id, for the driver, as it
keeps the stateful session a request names (`X-Amzn-SageMaker-Session-Id`) and the model it
targets (`X-Amzn-SageMaker-Target-Model`)."""

from __future__ import annotations

import copy
from typing import Any

import uvicorn.config
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from handlers.server.request_ids import bound, install_log_ids, new_id
from handlers.server.sessions import SESSION_HEADER
from handlers.server.tracing import TRACE_HEADERS

SAGEMAKER_HEADER = "X-Amzn-SageMaker-Inference-Id"
TARGET_MODEL_HEADER = "X-Amzn-SageMaker-Target-Model"  # which loaded model a request is for
REQUEST_ID_HEADER = "X-Request-Id"


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp, trace_headers: bool = False) -> None:
        self.app = app
        self.trace_headers = trace_headers  # keep the caller's trace context (traces are on)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        given = headers.get(SAGEMAKER_HEADER)
        request_id = new_id(given, headers.get(REQUEST_ID_HEADER))
        request_id.session = headers.get(SESSION_HEADER)
        request_id.target = headers.get(TARGET_MODEL_HEADER)
        if self.trace_headers:
            request_id.trace_headers = {name: headers[name] for name in TRACE_HEADERS
                                        if name in headers}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                out = MutableHeaders(scope=message)
                out[REQUEST_ID_HEADER] = request_id.value  # a body's id may have replaced it
                if given is not None:
                    out[SAGEMAKER_HEADER] = given
            await send(message)

        with bound(request_id):
            await self.app(scope, receive, send_with_id)


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's logging, its access lines carrying the request id too (uvicorn's access
    formatter ignores the message, where the other lines carry it), and every line on stdout
    as the server's own are (uvicorn writes all but its access lines to stderr), as DJL
    Serving logs."""
    install_log_ids()  # every record has `request_id` before uvicorn formats one
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    for handler in config["handlers"].values():
        handler["stream"] = "ext://sys.stdout"
    access = config["formatters"]["access"]
    access["fmt"] = access["fmt"].replace("%(levelprefix)s", "%(levelprefix)s [%(log_ids)s]", 1)
    return config
