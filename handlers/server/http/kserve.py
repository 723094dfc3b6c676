"""KServe over HTTP: V1 (`/v1/models/{m}`, `:predict`, `:explain`) and the V2 Open Inference
Protocol (`/v2`, health, model metadata and readiness, `/infer`, versioned routes), with Triton's
binary tensor data extension (`Inference-Header-Content-Length`) that `tritonclient.http` uses
by default. `GET /v1/models` is the merged list (models.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from handlers.engine.types import RequestValidationError
from handlers.protocols import kserve_v1, kserve_v2
from handlers.protocols.errors import ErrorKind, KServeError
from handlers.protocols.kserve_v2 import RestInferRequest
from handlers.protocols.schemas.kserve import (
    InferResponse,
    KServeErrorBody,
    Live,
    ModelMetadata,
    Ready,
    ReadyAnswer,
    ServerMetadata,
    V1Predictions,
    V1Request,
)
from handlers.server import driver
from handlers.server.context import ServerContext
from handlers.server.framing import Answer, Reply
from handlers.server.http.answers import BINARY_HEADER_LENGTH, disconnect_watch, to_response
from handlers.server.http.body import (
    BodyError,
    adopt_request_id,
    decode_json,
    read_body,
)
from handlers.server.http.descriptor import (
    BINARY,
    JSON,
    STRING,
    Doc,
    Operation,
    Protocol,
    error_bodies,
)
from handlers.server.http.guard import HttpProtocol, guarded, read_then
from handlers.server.status import HTTP

log = logging.getLogger(__name__)

V1 = HttpProtocol("KServe V1", HTTP, KServeError, KServeError.of)
V2 = HttpProtocol("KServe V2", HTTP, KServeError, KServeError.of)


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()
    _v1_routes(routes, ctx)
    _v2_routes(routes, ctx)
    return routes


# --- V1 -----------------------------------------------------------------------------------------


def _v1_routes(routes: APIRouter, ctx: ServerContext) -> None:
    @routes.get("/v1/models/{model}")
    async def model_ready(model: str) -> Response:
        served = _served(ctx, model)
        if served is None:
            return to_response(V1.error(kserve_v1.model_not_found(model).message,
                                        ErrorKind.NOT_FOUND))
        return to_response(Reply(200 if served.ready else 503,
                                 {"name": model, "ready": served.ready}))

    @routes.post("/v1/models/{model}:predict")
    async def predict(model: str, request: Request) -> Response:
        return to_response(await read_then(V1, request, ctx.settings.max_request_size,
                                           lambda body: _predict(ctx, request, model, body)))

    @routes.post("/v1/models/{model}:explain")
    async def explain(model: str) -> Response:
        if _served(ctx, model) is None:
            return to_response(V1.error(kserve_v1.model_not_found(model).message,
                                        ErrorKind.NOT_FOUND))
        return to_response(V1.error("explain is not supported: a language model has no "
                                    "explainer here; use :predict", ErrorKind.UNSUPPORTED))


def _served(ctx: ServerContext, model: str) -> Any:
    return ctx.served(model)


async def _predict(ctx: ServerContext, request: Request, model: str, body: Any) -> Answer:
    async def answer() -> Answer:
        served = _served(ctx, model)
        if served is None:
            raise kserve_v1.model_not_found(model)
        await served.loaded()
        engine = served.ready_engine(KServeError)
        if served.embeds:
            try:
                result = await engine.embed(kserve_v1.texts(body))
            except RequestValidationError as exc:
                raise KServeError(exc.message) from None
            return Reply(200, kserve_v1.render_predictions(result.vectors))
        pairs = kserve_v1.generation_requests(body)
        generation = await ctx.generation(engine, [gen for gen, _ in pairs], kserve_v1.CHECKS)
        folded = await driver.complete(generation, disconnect_watch(request))
        texts = [(gen.prompt if full else "") + acc.sequences[0].text
                 for (gen, full), acc in zip(pairs, folded, strict=True)]
        return Reply(200, kserve_v1.render_predictions(texts))

    return await guarded(V1, answer)


# --- V2 -----------------------------------------------------------------------------------------


def _v2_routes(routes: APIRouter, ctx: ServerContext) -> None:
    @routes.get("/v2")
    async def server_metadata() -> Response:
        return to_response(Reply(200, {"name": "lmi-serve", "version":
                                       ctx.settings.server_version,
                                       "extensions": kserve_v2.EXTENSIONS}))

    @routes.get("/v2/health/live")
    async def live() -> Response:
        return to_response(Reply(200, {"live": True}))

    @routes.get("/v2/health/ready")
    async def ready() -> Response:
        is_ready = ctx.ready()
        return to_response(Reply(200 if is_ready else 503, {"ready": is_ready}))

    for versioned in ("", "/versions/{version}"):
        prefix = "/v2/models/{model}" + versioned
        routes.add_api_route(prefix, _model_metadata(ctx), methods=["GET"])
        routes.add_api_route(prefix + "/ready", _model_ready(ctx), methods=["GET"])
        routes.add_api_route(prefix + "/infer", _infer_route(ctx), methods=["POST"])


def _generator(ctx: ServerContext, model: str, version: str | None) -> Any:
    """The served generation model `model` names (itself or one of its adapters), or a 404."""
    generator = ctx.generation_model(model)
    kserve_v2.check_model(model, version, generator and generator.name,
                          ctx.adapters(generator))
    return generator


def _model_metadata(ctx: ServerContext) -> Callable[..., Any]:
    async def model_metadata(model: str, version: str | None = None) -> Response:
        async def answer() -> Answer:
            _generator(ctx, model, version)
            return Reply(200, kserve_v2.model_metadata(model))

        return to_response(await guarded(V2, answer))

    return model_metadata


def _model_ready(ctx: ServerContext) -> Callable[..., Any]:
    async def model_ready(model: str, version: str | None = None) -> Response:
        async def answer() -> Answer:
            served = _generator(ctx, model, version)
            return Reply(200 if served.ready else 503, {"name": model, "ready": served.ready})

        return to_response(await guarded(V2, answer))

    return model_ready


def _infer_route(ctx: ServerContext) -> Callable[..., Any]:
    async def infer(model: str, request: Request, version: str | None = None) -> Response:
        return to_response(await _infer(ctx, request, model, version))

    return infer


async def _infer(ctx: ServerContext, request: Request, model: str, version: str | None
                 ) -> Answer:
    async def answer() -> Answer:
        generator = _generator(ctx, model, version)
        engine = generator.ready_engine(KServeError)
        header, binary = await _read_infer_body(request, ctx.settings.max_request_size)
        infer = kserve_v2.parse_rest_request(header, binary)
        adopt_request_id(infer.id)
        adapter = None if model == generator.name else model  # _generator checked it
        gens, params = kserve_v2.generation_requests(infer, adapter)
        generation = await ctx.generation(engine, gens, kserve_v2.CHECKS,
                                    kserve_v2.timeout_seconds(infer))
        folded = await driver.complete(generation, disconnect_watch(request))
        texts = [(gen.prompt if params.return_full_text else "") + acc.sequences[0].text
                 for gen, acc in zip(gens, folded, strict=True)]
        content, tail = kserve_v2.render_response(model, infer, texts)
        return Reply(200, content, tail=tail)

    return await guarded(V2, answer)


async def _read_infer_body(request: Request, limit: int) -> tuple[Any, bytes]:
    """The JSON header and the binary data after it (Triton's binary tensor data extension)."""
    try:
        raw = await read_body(request, limit)
        size = _json_length(request, len(raw))
        return decode_json(raw[:size], "the request's JSON is not valid"), raw[size:]
    except BodyError as exc:
        raise KServeError(exc.message, exc.kind) from None


def _json_length(request: Request, size: int) -> int:
    """How many of the body's `size` bytes are JSON: those Triton's header says, else all."""
    declared = request.headers.get(BINARY_HEADER_LENGTH)
    if declared is None:
        return size
    if not declared.isdigit() or int(declared) > size:
        raise BodyError(f"{BINARY_HEADER_LENGTH}: {declared!r} is not a length within the "
                        f"{size}-byte body", ErrorKind.VALIDATION)
    return int(declared)


ERRORS = error_bodies(KServeErrorBody, 400, 404, 408, 413, 500, 503)
BINARY_LENGTH = {"name": "Inference-Header-Content-Length", "in": "header", "required": False,
                 "description": "Triton's binary tensor data extension: the length of the JSON "
                                "header; binary tensor data follows it",
                 "schema": {"type": "string", "pattern": "^[0-9]+$"}}
_NOT_READY = {404: KServeErrorBody, 503: ReadyAnswer}


def _v2_model_docs(versioned: str) -> dict[Operation, Doc]:
    """The V2 model routes under `/v2/models/{model}` + `versioned` (generate.py has more)."""
    docs = {
        ("get", ""): Doc("KServe V2 model metadata", ok={JSON: ModelMetadata},
                         errors=error_bodies(KServeErrorBody, 404)),
        ("get", "/ready"): Doc("KServe V2 model readiness", ok={JSON: ReadyAnswer},
                               errors=_NOT_READY),
        ("post", "/infer"): Doc(
            "KServe V2 inference (JSON, or Triton's binary tensor data extension with "
            "Inference-Header-Content-Length)", RestInferRequest,
            {JSON: InferResponse, BINARY: STRING}, ERRORS, (JSON, BINARY), (BINARY_LENGTH,)),
    }
    return {(method, f"/v2/models/{{model}}{versioned}{tail}"): doc
            for (method, tail), doc in docs.items()}


PROTOCOL = Protocol(router, {
    ("get", "/v1/models/{model}"): Doc("KServe V1 model readiness", ok={JSON: ReadyAnswer},
                                       errors=_NOT_READY),
    ("post", "/v1/models/{model}:predict"): Doc("KServe V1 predict", V1Request,
                                                {JSON: V1Predictions}, ERRORS),
    ("post", "/v1/models/{model}:explain"): Doc(
        "KServe V1 explain: not supported (501)",
        errors=error_bodies(KServeErrorBody, 404, 501)),
    ("get", "/v2"): Doc("KServe V2 server metadata", ok={JSON: ServerMetadata}),
    ("get", "/v2/health/live"): Doc("KServe V2 liveness", ok={JSON: Live}),
    ("get", "/v2/health/ready"): Doc("KServe V2 readiness", ok={JSON: Ready},
                                     errors={503: Ready}),
    **_v2_model_docs(""),
    **_v2_model_docs("/versions/{version}"),
})
