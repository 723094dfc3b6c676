"""Triton's generate extension as MindIE Service serves it, over HTTP:
`POST /v2/models/{m}[/versions/{v}]/generate` (one JSON answer) and `…/generate_stream`
(`data:{...}` events, one per generated token). Errors are Triton's `{"error": "..."}`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from handlers.engine.base import Engine
from handlers.protocols.checks import naming
from handlers.protocols.errors import KServeError
from handlers.protocols.generate import (
    GenerateRenderer,
    GenerateRequest,
    generation_request,
    parse_generate_request,
)
from handlers.protocols.kserve_v2 import check_model
from handlers.protocols.schemas.kserve import GenerateAnswer
from handlers.server import driver
from handlers.server.context import ServerContext
from handlers.server.framing import Answer, Framing, Reply
from handlers.server.http.answers import disconnect_watch, to_response
from handlers.server.http.descriptor import JSON, SSE, SSE_EVENT, Doc, Protocol
from handlers.server.http.guard import HttpProtocol, guarded, read_then
from handlers.server.http.kserve import ERRORS
from handlers.server.status import HTTP

GENERATE = HttpProtocol("generate", HTTP, KServeError, KServeError.of)
CHECKS = naming(KServeError, lambda _: "text_input")


VERSIONED = ("", "/versions/{version}")


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()
    for versioned in VERSIONED:
        prefix = "/v2/models/{model}" + versioned
        routes.add_api_route(prefix + "/generate", _route(ctx, stream=False), methods=["POST"])
        routes.add_api_route(prefix + "/generate_stream", _route(ctx, stream=True),
                             methods=["POST"])
    return routes


def _route(ctx: ServerContext, stream: bool) -> Callable[..., Any]:
    async def generate(model: str, request: Request, version: str | None = None) -> Response:
        return to_response(await read_then(
            GENERATE, request, ctx.settings.max_request_size,
            lambda body: _answer(ctx, request, model, version, body, stream)))

    return generate


def _engine(ctx: ServerContext, model: str, version: str | None
            ) -> tuple[Engine, str | None]:
    """The engine, and the LoRA adapter `model` names (None: the model itself)."""
    generator = ctx.generation_model(model)
    adapter = check_model(model, version, generator and generator.name, ctx.adapters(generator))
    assert generator is not None  # check_model refuses a server without one
    return generator.ready_engine(KServeError), adapter


async def _answer(ctx: ServerContext, request: Request, model: str, version: str | None,
                  body: Any, stream: bool) -> Answer:
    async def answer() -> Answer:
        engine, adapter = _engine(ctx, model, version)
        parsed = parse_generate_request(body)
        gen = generation_request(parsed, adapter)
        generation = await ctx.generation(engine, [gen], CHECKS, parsed.parameters.timeout)
        renderer = GenerateRenderer(parsed, model, version, gen.arrival_time,
                                    ctx.settings.full_text_enabled)
        watch = disconnect_watch(request)
        if stream:
            return await driver.stream(generation, renderer, Framing.SSE_COMPACT, watch)
        await driver.collect(generation, renderer.feed, watch)
        return Reply(200, renderer.whole())

    return await guarded(GENERATE, answer)


_WHOLE = Doc("Triton / MindIE generate", GenerateRequest, {JSON: GenerateAnswer}, ERRORS)
_STREAM = Doc("Triton / MindIE generate (one event per token)", GenerateRequest,
              {SSE: SSE_EVENT}, ERRORS)
PROTOCOL = Protocol(router, {
    **{("post", f"/v2/models/{{model}}{versioned}/generate"): _WHOLE for versioned in VERSIONED},
    **{("post", f"/v2/models/{{model}}{versioned}/generate_stream"): _STREAM
       for versioned in VERSIONED},
})
