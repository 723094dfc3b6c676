"""Triton's generate extension as MindIE serves it (seed 000), over HTTP:
`POST /v2/models/{m}[/versions/{v}]/generate` (one JSON answer) and `…/generate_stream`
(`data:{...}` events, one per generated token). Errors are Triton's `{"error": "..."}`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from handlers.engine.base import Engine, Pair
from handlers.protocols.errors import ErrorKind, GenerationError, KServeError
from handlers.protocols.generate import (
    GenerateRenderer,
    error_event,
    generation_request,
    parse_generate_request,
)
from handlers.protocols.kserve_v2 import check_version
from handlers.protocols.outputs import Event, output_failure
from handlers.server.context import ServerContext
from handlers.server.framing import Answer, Framing, Reply, StreamReply
from handlers.server.generation import Generation, collect, first, validate_each
from handlers.server.http.guard import HttpProtocol, guarded, read_then
from handlers.server.http.responses import disconnect_watch, to_response
from handlers.server.status import HTTP

log = logging.getLogger(__name__)

GENERATE = HttpProtocol("generate", HTTP, KServeError, KServeError.of)


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()
    for versioned in ("", "/versions/{version}"):
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


def _engine(ctx: ServerContext, model: str, version: str | None) -> Engine:
    if ctx.generator is None or ctx.generator.name != model:
        raise KServeError(f"model '{model}' is not served here", ErrorKind.NOT_FOUND)
    check_version(model, version)
    return ctx.generator.ready_engine(KServeError)


async def _answer(ctx: ServerContext, request: Request, model: str, version: str | None,
                  body: Any, stream: bool) -> Answer:
    async def answer() -> Answer:
        engine = _engine(ctx, model, version)
        parsed = parse_generate_request(body)
        gen = generation_request(parsed)
        validate_each(engine, [gen], lambda _: "text_input", KServeError)
        generation = ctx.generation(engine, [gen], parsed.parameters.timeout)
        renderer = GenerateRenderer(parsed, model, version, gen.arrival_time,
                                    ctx.settings.full_text_enabled)
        watch = disconnect_watch(request)
        if stream:
            events = await first(generation, lambda pairs: _events(renderer, pairs), watch)
            return StreamReply(_stream(events or [], generation, renderer),
                               Framing.SSE_COMPACT)
        await collect(generation, lambda pairs: _events(renderer, pairs), watch)
        return Reply(200, renderer.whole())

    return await guarded(GENERATE, answer)


def _events(renderer: GenerateRenderer, pairs: list[Pair]) -> list[Event]:
    """The events of these outputs; the protocol's error when one failed the request."""
    now = time.monotonic()
    events = []
    for _, output in pairs:
        if (failure := output_failure(output)) is not None:
            raise KServeError(failure.message, failure.kind)
        events.extend(renderer.feed(output, now))
    return events


async def _stream(events: list[Event], generation: Generation, renderer: GenerateRenderer
                  ) -> AsyncIterator[list[Event]]:
    """One chunk per event (each token goes out as it is made); a failure, one error event."""
    try:
        for event in events:
            yield [event]
        async for pairs in generation:
            for event in _events(renderer, pairs):
                yield [event]
    except (KServeError, GenerationError) as exc:
        log.warning("generation failed mid-stream: %s", exc.message)
        yield [error_event(exc.message)]
    finally:
        await generation.aclose()
