"""SageMaker's and DJL LMI's entry: `POST /invocations` and `POST /predictions/{model}`.

Which protocol a body speaks is decided here, once, by `BODY_ROUTES` in order: `messages` is an
OpenAI chat completion, `prompt` a completion, `input` embeddings; anything else is LMI's
schema. The SageMaker runtime routes and Databricks' endpoints answer through the same table.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from handlers.protocols.errors import ErrorKind
from handlers.server.context import ServerContext
from handlers.server.framing import Answer
from handlers.server.http.embeddings import embeddings_body
from handlers.server.http.guard import read_then
from handlers.server.http.lmi import LMI, lmi_body
from handlers.server.http.openai import BodyHandler, chat_body, completion_body
from handlers.server.http.responses import to_response

BODY_ROUTES: tuple[tuple[str, BodyHandler], ...] = (
    ("messages", chat_body),
    ("prompt", completion_body),
    ("input", embeddings_body),
)


def body_handler(body: Any) -> BodyHandler:
    """The handler of the protocol a decoded body speaks."""
    if isinstance(body, dict):
        return next((handler for key, handler in BODY_ROUTES if key in body), lmi_body)
    return lmi_body


async def invoke(ctx: ServerContext, request: Request) -> Answer:
    """Answer an invocation body, whichever protocol it speaks (one that cannot be read is
    refused in LMI's shape)."""
    return await read_then(LMI, request, ctx.settings.max_request_size,
                           lambda body: body_handler(body)(ctx, request, body))


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()

    @routes.post("/invocations")
    async def invocations(request: Request) -> Response:
        return to_response(await invoke(ctx, request))

    @routes.post("/predictions/{model}")
    async def predictions(model: str, request: Request) -> Response:
        served = ctx.settings.model_name
        if model != served:
            message = f"model '{model}' not found; this server serves '{served}'"
            return to_response(LMI.error(message, ErrorKind.NOT_FOUND))
        return to_response(await invoke(ctx, request))

    return routes
