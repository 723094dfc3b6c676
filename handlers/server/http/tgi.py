"""TGI's own routes: `POST /generate`, `POST /generate_stream`, `POST /` (TGI's compat route:
`stream` chooses, and a whole answer is a JSON list of one), `GET /info`, `GET /health` (and
`GET /`, TGI's health too). As TGI does, a stream answers 200 at once and reports every failure,
validation included, as an event; whole answers get 422, 424 or 429.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from handlers.protocols import tgi
from handlers.protocols.errors import ErrorKind, GenerationError
from handlers.protocols.outputs import Event
from handlers.protocols.schemas.tgi import TgiErrorBody, TgiGenerated, TgiInfo
from handlers.protocols.tgi import Rendering, StreamEvents, TgiError, TgiRequest
from handlers.server import driver
from handlers.server.context import ServerContext
from handlers.server.framing import Answer, Framing, Reply, StreamReply
from handlers.server.generation import Generation
from handlers.server.http.answers import disconnect_watch, to_response
from handlers.server.http.descriptor import EMPTY, JSON, SSE, SSE_EVENT, Doc, Protocol, error_bodies
from handlers.server.http.guard import HttpProtocol, guarded, read_then
from handlers.server.status import HTTP, Table

log = logging.getLogger(__name__)

# TGI: 422 validation, 424 a failed generation, 429 overloaded.
TGI_HTTP: Table[ErrorKind, int] = Table(
    {**HTTP, ErrorKind.VALIDATION: 422, ErrorKind.FAILED: 424, ErrorKind.OVERLOADED: 429})
TGI = HttpProtocol("TGI", TGI_HTTP, TgiError, TgiError.of)
Mode = Literal["generate", "stream", "compat"]


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()
    for path, mode in (("/generate", "generate"), ("/generate_stream", "stream"),
                       ("/", "compat")):
        routes.add_api_route(path, _route(ctx, mode), methods=["POST"])

    @routes.get("/info")
    async def info() -> Response:
        return to_response(Reply(200, _info(ctx)))

    @routes.get("/health")
    @routes.get("/")
    async def health() -> Response:
        if ctx.ready():
            return Response(status_code=200)
        return to_response(Reply(503, {"error": "unhealthy", "error_type": "healthcheck"}))

    return routes


def _route(ctx: ServerContext, mode: Mode) -> Any:
    async def generate(request: Request) -> Response:
        return to_response(await read_then(TGI, request, ctx.settings.max_request_size,
                                           lambda body: _answer(ctx, request, body, mode)))

    return generate


def _info(ctx: ServerContext) -> dict[str, Any]:
    engine = ctx.generator.engine if ctx.generator is not None else None
    context = engine.max_model_len if engine is not None else None
    return {
        "model_id": ctx.settings.model_name,
        "model_sha": None,
        "model_dtype": None if engine is None else engine.dtype,
        "model_device_type": None if engine is None else engine.device,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": ctx.settings.job_queue_size,
        "max_best_of": tgi.MAX_BEST_OF,
        "max_stop_sequences": tgi.MAX_STOP_SEQUENCES,
        "max_input_tokens": None if context is None else context - 1,
        "max_total_tokens": context,
        "validation_workers": 1,
        "max_client_batch_size": 1,
        "router": "lmi-serve",
        "version": ctx.settings.server_version,
        "sha": None,
        "docker_label": None,
    }


async def _answer(ctx: ServerContext, request: Request, body: Any, mode: Mode
                  ) -> Answer:
    async def answer() -> Answer:
        parsed = tgi.parse_tgi_request(body)  # what does not parse is a 422, even for streams
        stream = parsed.stream if mode == "compat" else mode == "stream"
        if stream:
            return StreamReply(_stream(ctx, parsed), Framing.SSE)
        generation = await _start(ctx, parsed, stream=False)
        gen = generation.requests[0]
        rendering = Rendering.of(parsed, gen, compat=mode == "compat")
        folded = await driver.complete(generation, disconnect_watch(request))
        generated = tgi.render_generate(folded[0], rendering)
        return Reply(200, [generated] if mode == "compat" else generated)

    return await guarded(TGI, answer)


async def _start(ctx: ServerContext, parsed: TgiRequest, stream: bool) -> Generation:
    """TGI's validation, then the engine's and the output length; admitted and submitted."""
    engine = ctx.text_engine(TgiError, _not_a_text_model)
    tgi.validate(parsed, stream)
    gen = tgi.generation_request(parsed, ctx.name_of(engine), engine.adapters)
    return await ctx.generation(engine, [gen], tgi.checks(parsed))


def _not_a_text_model(model: str) -> TgiError:
    return TgiError(f"'{model}' is an embedding model: this server generates no text",
                    ErrorKind.NOT_FOUND)


async def _stream(ctx: ServerContext, parsed: TgiRequest) -> AsyncIterator[list[Event]]:
    """Every token as an event; any failure, from validation on, as the last event."""
    try:
        generation = await _start(ctx, parsed, stream=True)
    except (TgiError, GenerationError) as exc:
        error = exc if isinstance(exc, TgiError) else TgiError.of(exc)
        log.info("TGI stream refused: %s", error.message)
        yield [tgi.error_event(error)]
        return
    gen = generation.requests[0]
    events = StreamEvents(Rendering.of(parsed, gen, compat=False),
                          len(gen.prompt_token_ids or []))
    async for chunk in driver.events(generation, events):
        yield chunk


def _generate_doc(summary: str, ok: dict[str, Any]) -> Doc:
    return Doc(summary, TgiRequest, ok,
               error_bodies(TgiErrorBody, 404, 408, 413, 422, 424, 429, 500, 503))


_HEALTH = Doc("TGI health", ok={JSON: EMPTY}, errors={503: TgiErrorBody})
PROTOCOL = Protocol(router, {
    ("post", "/generate"): _generate_doc("TGI generate", {JSON: TgiGenerated}),
    ("post", "/generate_stream"): _generate_doc("TGI generate_stream (failures are events too)",
                                                {SSE: SSE_EVENT}),
    ("post", "/"): _generate_doc("TGI's compat route: `stream` chooses",
                                 {JSON: list[TgiGenerated], SSE: SSE_EVENT}),
    ("get", "/info"): Doc("TGI server info", ok={JSON: TgiInfo}),
    ("get", "/health"): _HEALTH,
    ("get", "/"): _HEALTH,
})
