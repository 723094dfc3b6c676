"""The FastAPI app factory: `create_app(engine, settings)`. No module-level app or state."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from handlers.engine.base import Engine
from handlers.engine.static_batcher import StaticBatcher
from handlers.protocols.lmi import LmiError
from handlers.protocols.lmi.errors import VALIDATION_STATUS
from handlers.server.body import BodyError, read_json, request_id
from handlers.server.dynamic_handler import DynamicBatching, DynamicHandler
from handlers.server.embedding_routes import EmbeddingSlot, add_embedding_routes
from handlers.server.lmi_handler import LmiHandler, lmi_error
from handlers.server.metrics import metrics_endpoint
from handlers.server.openai_routes import BodyRouter, add_openai_routes
from handlers.server.responses import json_response
from handlers.server.sagemaker import add_sagemaker_routes

log = logging.getLogger(__name__)

OUTPUT_FORMATTERS = ("json", "jsonlines", "sse")


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    output_formatter: str = "jsonlines"  # how `stream: true` is answered: json | jsonlines | sse
    tgi_compat: bool = False
    max_request_size: int = 64 * 1024 * 1024  # bytes; DJL's default
    dynamic_batching: DynamicBatching | None = None  # set when option.rolling_batch=disable
    full_text_enabled: bool = False  # MindIE's streamed chat with the whole text in each chunk
    embeddings_only: bool = False  # option.task=text-embedding: `model_name` is the embedding model

    def __post_init__(self) -> None:
        if self.output_formatter not in OUTPUT_FORMATTERS:
            raise ValueError(
                f"option.output_formatter must be one of {', '.join(OUTPUT_FORMATTERS)}; "
                f"got {self.output_formatter!r}"
            )


def create_app(engine: Engine, settings: ServerSettings,
               embeddings: EmbeddingSlot | None = None) -> FastAPI:
    """The server. `embeddings` receives the embedding model once loaded (None: none served)."""
    app = FastAPI(title="lmi-serve", docs_url=None, redoc_url=None, openapi_url=None)
    if settings.dynamic_batching is not None:
        # Batching is a server concern, as in DJL's frontend: every route's requests are batched.
        batching = settings.dynamic_batching
        engine = StaticBatcher(engine, batching.batch_size, batching.max_batch_delay_ms)
    openai = add_openai_routes(app, engine, settings)
    add_embedding_routes(app, embeddings, openai, settings.max_request_size)
    _add_lmi_routes(app, engine, settings, openai.route_for)
    app.add_api_route("/metrics", metrics_endpoint(engine, settings.model_name), methods=["GET"])
    return app


def _lmi_handler(engine: Engine, settings: ServerSettings) -> LmiHandler | DynamicHandler:
    """The dynamic-batch schema when requests are batched statically, else rolling batch's."""
    if isinstance(engine, StaticBatcher) and settings.dynamic_batching is not None:
        return DynamicHandler(engine, settings.dynamic_batching.streaming)
    return LmiHandler(engine, settings.output_formatter, settings.tgi_compat)


def _add_lmi_routes(app: FastAPI, engine: Engine, settings: ServerSettings,
                    route_openai: BodyRouter) -> None:
    lmi = _lmi_handler(engine, settings)

    async def invoke(request: Request) -> Response:
        rid = request_id(request)
        try:
            body = await read_json(request, settings.max_request_size, VALIDATION_STATUS)
        except BodyError as exc:
            log.info("[RequestId=%s] bad body: %s", rid, exc.message)
            return lmi_error(LmiError(exc.message, exc.status))
        try:
            # `messages` -> chat, `prompt` -> completions, `input` -> embeddings (OpenAI's
            # shapes, each answering "still loading" its own way); else the LMI schema.
            if (openai := route_openai(body)) is not None:
                return await openai(request, body, rid)
            if not engine.is_ready():
                return lmi_error(LmiError("the model is still loading", 503))
            return await lmi(request, body, rid)
        except Exception:
            log.exception("[RequestId=%s] unexpected error", rid)
            return lmi_error(LmiError("internal server error", 500))

    @app.get("/ping")
    async def ping() -> Response:
        if engine.is_ready():
            return json_response({"status": "Healthy"})
        return json_response({"status": "Unhealthy"}, 503)

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        return await invoke(request)

    @app.post("/predictions/{model}")
    async def predictions(model: str, request: Request) -> Response:
        if model != settings.model_name:
            message = f"model '{model}' not found; this server serves '{settings.model_name}'"
            return lmi_error(LmiError(message, 404))
        return await invoke(request)

    add_sagemaker_routes(app, invoke)
