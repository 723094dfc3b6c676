"""The FastAPI app factory: `create_app(engine, settings)`. No module-level app or state."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from handlers.engine.base import Engine
from handlers.protocols.lmi import LmiError
from handlers.protocols.lmi.errors import VALIDATION_STATUS
from handlers.server.body import BodyError, read_json, request_id
from handlers.server.lmi_handler import LmiHandler, lmi_error
from handlers.server.metrics import metrics_endpoint
from handlers.server.sagemaker import add_sagemaker_routes

log = logging.getLogger(__name__)

OUTPUT_FORMATTERS = ("json", "jsonlines", "sse")


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    output_formatter: str = "jsonlines"  # how `stream: true` is answered: json | jsonlines | sse
    tgi_compat: bool = False
    max_request_size: int = 64 * 1024 * 1024  # bytes; DJL's default

    def __post_init__(self) -> None:
        if self.output_formatter not in OUTPUT_FORMATTERS:
            raise ValueError(
                f"option.output_formatter must be one of {', '.join(OUTPUT_FORMATTERS)}; "
                f"got {self.output_formatter!r}"
            )


def json_response(content: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status, media_type="application/json")


def create_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="lmi-serve", docs_url=None, redoc_url=None, openapi_url=None)
    _add_lmi_routes(app, engine, settings)
    app.add_api_route("/metrics", metrics_endpoint(engine, settings.model_name), methods=["GET"])
    return app


def _add_lmi_routes(app: FastAPI, engine: Engine, settings: ServerSettings) -> None:
    lmi = LmiHandler(engine, settings.output_formatter, settings.tgi_compat)

    async def invoke(request: Request) -> Response:
        rid = request_id(request)
        try:
            body = await read_json(request, settings.max_request_size, VALIDATION_STATUS)
        except BodyError as exc:
            log.info("[RequestId=%s] bad body: %s", rid, exc.message)
            return lmi_error(LmiError(exc.message, exc.status))
        if not engine.is_ready():
            return lmi_error(LmiError("the model is still loading", 503))
        try:
            # Body-based routing lands here: `messages` -> chat, `prompt` -> completions,
            # `input` -> embeddings; everything else is the LMI schema.
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
