"""SageMaker's and DJL LMI's entry: `POST /invocations` and `POST /predictions/{model}`.

Which protocol a body speaks is decided here, once (`Invocations.body`), from the bodies the
protocols declare (`descriptor.Body`); the SageMaker runtime routes answer through it too. As
declared today, a JSON object is, in this order:

0. a stateful session's `requestType` (NEW_SESSION, CLOSE: http/sessions.py);
1. an Anthropic Messages request when it has `messages` and says so (http/anthropic.py);
2. an OpenAI chat completion when it has `messages`;
3. an OpenAI Responses request when it has `input` and is meant for the generation model
   (http/responses_api.py);
4. a completion when it has `prompt`;
5. embeddings when it has `input`;
6. else LMI's schema, as anything that is not an object.

The LoRA adapter may be named outside the body, whatever the body speaks, first found wins (DJL
LMI's order): SageMaker's adapter header (`X-Amzn-SageMaker-Adapter-Identifier`, inference
components), `adapter=NAME` in `X-Amzn-SageMaker-Custom-Attributes` (`;`-separated pairs, as DJL
Serving splits them), then the `adapter` query parameter. It sets the body's own selector, over
what the body says (as vLLM's SageMaker integration sets `model`, and DJL LMI reads these before
`adapters`).
"""

from __future__ import annotations

import typing
from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response

from handlers.protocols.errors import ErrorKind
from handlers.server.context import ServerContext
from handlers.server.framing import Answer
from handlers.server.http.answers import to_response
from handlers.server.http.descriptor import (
    ADAPTER_HEADER,
    CUSTOM_ATTRIBUTES,
    Body,
    Doc,
    Protocol,
    merged,
)
from handlers.server.http.guard import read_then
from handlers.server.http.lmi import LMI
from handlers.server.request_ids import target_model


class EntryCode(typing.Protocol):
    """Code a user put at LMI's entry (a model.py: handlers/djl/custom_entry.py). It answers
    the raw bodies sent to the server's own model, handing bodies on to `entry`."""

    async def answer(self, ctx: ServerContext, request: Request, raw: bytes,
                     entry: Invocations) -> Answer: ...

    def forget_adapter(self, name: str) -> None:
        """LoRA adapter `name` was unregistered: its own code no longer applies."""


class Invocations:
    """The bodies every protocol answers on /invocations, and the answer to one."""

    def __init__(self, bodies: Iterable[Body]) -> None:
        self.bodies = sorted(bodies, key=lambda body: body.order)
        fallbacks = [body for body in self.bodies if body.speaks is None]
        if len(fallbacks) != 1:
            raise ValueError("exactly one protocol takes the bodies no other speaks")
        self.fallback = fallbacks[0]

    def body(self, ctx: ServerContext, body: Any, headers: Headers) -> Body:
        """Which protocol's body a decoded body is (the module's docstring says how)."""
        if not isinstance(body, dict):
            return self.fallback
        return next(body_of for body_of in self.bodies
                    if body_of.speaks is None or body_of.speaks(ctx, body, headers))

    async def invoke(self, ctx: ServerContext, request: Request) -> Answer:
        """Answer an invocation body, whichever protocol it speaks (one that cannot be read is
        refused in LMI's shape); a model.py's code answers those for the server's own model."""
        limit = ctx.settings.max_request_size
        code = ctx.entry_code
        if code is not None and ctx.targeted() in (None, ctx.settings.model_name):
            return await read_then(LMI, request, limit,
                                   lambda raw: code.answer(ctx, request, raw, self), bytes)
        return await read_then(LMI, request, limit, lambda body: self.answer(
            ctx, request, body, requested_adapter(request)))

    async def answer(self, ctx: ServerContext, request: Request, body: Any,
                     adapter: str | None) -> Answer:
        """Answer a decoded body as the protocol it speaks; `adapter` (named outside the body)
        sets the body's own selector."""
        body_of = self.body(ctx, body, request.headers)
        if adapter is not None and isinstance(body, dict):
            body = {**body, body_of.selector: adapter}
        return await body_of.handler(ctx, request, body)

    def doc(self, summary: str) -> Doc:
        return merged(summary, [body.doc for body in self.bodies])


def requested_adapter(request: Request) -> str | None:
    """The adapter named outside the body (the module's docstring says where), or None."""
    named = request.headers.get(ADAPTER_HEADER)
    if named is not None:
        return named
    for pair in request.headers.get(CUSTOM_ATTRIBUTES, "").split(";"):
        key, sep, value = pair.partition("=")
        if sep and key.strip() == "adapter":
            return value.strip()
    return request.query_params.get("adapter")


def protocol(entry: Invocations) -> Protocol:
    return Protocol(lambda ctx: _router(ctx, entry), {
        ("post", "/invocations"): entry.doc(
            "SageMaker / DJL LMI: Anthropic Messages (`messages` with an `anthropic-version` "
            "header, `anthropic_version`, `system` or tool_use/tool_result blocks), OpenAI chat "
            "(`messages`), Responses (`input` for the generation model), completion "
            "(`prompt`), embeddings (`input`), else LMI's schema (`inputs`, `parameters`, "
            "`stream`)"),
        ("post", "/predictions/{model}"): entry.doc("DJL's predictions: as /invocations"),
    })


def _router(ctx: ServerContext, entry: Invocations) -> APIRouter:
    routes = APIRouter()

    @routes.post("/invocations")
    async def invocations(request: Request) -> Response:
        return to_response(await entry.invoke(ctx, request))

    @routes.post("/predictions/{model}")
    async def predictions(model: str, request: Request) -> Response:
        served = ctx.settings.model_name
        if ctx.fleet is not None and model in ctx.fleet.models:
            target_model(model)  # a model loaded at runtime answers under its name
        elif model != served:
            message = f"model '{model}' not found; this server serves '{served}'"
            return to_response(LMI.error(message, ErrorKind.NOT_FOUND))
        return to_response(await entry.invoke(ctx, request))

    return routes
