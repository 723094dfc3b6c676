"""SageMaker's multi-model endpoint contract for containers (handlers/server/fleet.py keeps the
models): `POST /models` loads `{"model_name", "url"}` (409 for a name loaded already, 507 when
it cannot fit), `GET /models` lists them (`limit`, `next_page_token`), `GET /models/{name}`
describes one, `DELETE /models/{name}` unloads it, and `POST /models/{name}/invoke` answers as
`/invocations` does, for that model (404 for one not loaded). A model is read only from the
allowed roots (SageMaker's /opt/ml/models, the model directory, the model cache), or fetched
from `s3://` / the Hub into the cache where option.allow_runtime_fetch allows it, as the
adapter API reads adapters. Errors are DJL's management bodies `{"code", "type", "message"}`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from handlers.config import values
from handlers.model_source import ModelSourceError, model_files_in
from handlers.protocols.adapter_management import (
    DjlManagementError,
    LoadModel,
    load_model_body,
    page,
)
from handlers.protocols.errors import ErrorKind
from handlers.protocols.schemas.djl import DjlErrorBody, DjlStatus
from handlers.protocols.schemas.sagemaker import LoadedModel, LoadedModelList
from handlers.server.adapter_sources import SourceRefused, as_sent, resolve_source
from handlers.server.context import ServerContext
from handlers.server.fleet import FleetError, FleetModel
from handlers.server.framing import Answer, Reply
from handlers.server.http.answers import to_response
from handlers.server.http.descriptor import JSON, Doc, Protocol, error_bodies
from handlers.server.http.guard import HttpProtocol, guarded, read_then
from handlers.server.http.invocations import Invocations
from handlers.server.request_ids import target_model
from handlers.server.status import HTTP

log = logging.getLogger(__name__)

MANAGEMENT = HttpProtocol("model management", HTTP, DjlManagementError,
                          lambda error: DjlManagementError(error.message, error.kind))
MODEL_FILES = (".gguf",)  # a model may be one file as well as a directory


def protocol(entry: Invocations) -> Protocol:
    invoke = entry.doc("")
    errors = error_bodies(DjlErrorBody, 400, 404, 409, 500, 507)
    return Protocol(lambda ctx: _router(ctx, entry), {
        ("post", "/models"): Doc("SageMaker multi-model: load a model", LoadModel,
                                 {JSON: DjlStatus}, errors),
        ("get", "/models"): Doc("SageMaker multi-model: the models loaded",
                                ok={JSON: LoadedModelList}, errors=errors),
        ("get", "/models/{model}"): Doc("SageMaker multi-model: one loaded model",
                                       ok={JSON: LoadedModel}, errors=errors),
        ("delete", "/models/{model}"): Doc("SageMaker multi-model: unload a model",
                                          ok={JSON: DjlStatus}, errors=errors),
        ("post", "/models/{model}/invoke"): Doc(
            "SageMaker multi-model: invoke a loaded model, as /invocations", invoke.request,
            invoke.ok, invoke.errors),
    })


def _router(ctx: ServerContext, entry: Invocations) -> APIRouter:
    routes = APIRouter()

    @routes.post("/models")
    async def load(request: Request) -> Response:
        return to_response(await read_then(MANAGEMENT, request, ctx.settings.max_request_size,
                                           lambda body: guarded(MANAGEMENT,
                                                                lambda: _load(ctx, body))))

    @routes.get("/models")
    async def listed(request: Request) -> Response:
        async def answer() -> Answer:
            models = ctx.fleet.models.values() if ctx.fleet is not None else ()
            return Reply(200, page(dict(request.query_params),
                                   [_described(m) for m in models], "models"))

        return to_response(await guarded(MANAGEMENT, answer))

    @routes.get("/models/{model}")
    async def described(model: str) -> Response:
        return to_response(await guarded(MANAGEMENT, lambda: _describe(ctx, model)))

    @routes.delete("/models/{model}")
    async def unload(model: str) -> Response:
        return to_response(await guarded(MANAGEMENT, lambda: _unload(ctx, model)))

    @routes.post("/models/{model}/invoke")
    async def invoke(model: str, request: Request) -> Response:
        target_model(model)  # the path names the model, whatever the header says
        return to_response(await entry.invoke(ctx, request))

    return routes


async def _load(ctx: ServerContext, body: Any) -> Answer:
    wanted = load_model_body(body)
    try:
        values.model_name(wanted.model_name)  # requests name it in URL paths
    except ValueError as exc:
        raise DjlManagementError(f"model_name={wanted.model_name!r}: {exc}") from None
    fleet = _fleet(ctx)  # a server that loads no models reads and fetches nothing
    if ctx.served(wanted.model_name) is not None and wanted.model_name not in fleet.models:
        return _refused(FleetError(409, f"model {wanted.model_name!r} is the server's own"))
    settings = ctx.settings
    try:
        path = await ctx.offload(resolve_source, wanted.url, settings.model_roots,
                                 settings.model_dir, "models", "url", MODEL_FILES,
                                 fetch_allowed=settings.runtime_fetch)
        await ctx.offload(_holds_a_model, path, wanted.url)
    except SourceRefused as exc:
        raise DjlManagementError(str(exc)) from None
    try:
        await fleet.load(wanted.model_name, path, wanted.url)
    except FleetError as exc:
        return _refused(exc)
    except Exception as exc:  # the model's files or its engine: the client's to fix or see
        log.exception("loading model %s from %s failed", wanted.model_name, path)
        said = as_sent(str(exc), path, wanted.url)
        raise DjlManagementError(f"model {wanted.model_name!r} failed to load: {said}",
                                 ErrorKind.INTERNAL) from None
    return Reply(200, {"status": f"Model {wanted.model_name} loaded"})


def _holds_a_model(path: Path, url: str) -> None:
    """SourceRefused, naming `url`, for a directory with no model the engines load."""
    if path.is_file():  # a .gguf (resolve_source takes no other file)
        return
    try:
        found = model_files_in(path)
    except ModelSourceError:  # its only refusal: several .gguf files, and no way to pick one
        raise SourceRefused(f"url={url!r} holds several .gguf files: name one of them") from None
    if found is None:
        raise SourceRefused(f"url={url!r} holds no model files (config.json with "
                            "*.safetensors, or one .gguf file)")


async def _describe(ctx: ServerContext, name: str) -> Answer:
    model = ctx.fleet.models.get(name) if ctx.fleet is not None else None
    if model is None:
        raise DjlManagementError(f"Model not found: {name}", ErrorKind.NOT_FOUND)
    return Reply(200, _described(model))


async def _unload(ctx: ServerContext, name: str) -> Answer:
    if ctx.fleet is None:
        raise DjlManagementError(f"Model not found: {name}", ErrorKind.NOT_FOUND)
    try:
        await ctx.fleet.unload(name)
    except FleetError as exc:
        return _refused(exc)
    return Reply(200, {"status": f"Model {name} unloaded"})


def _fleet(ctx: ServerContext) -> Any:
    if ctx.fleet is None:
        raise DjlManagementError("this server loads no models at runtime (an embeddings-only "
                                 "server serves its one model)")
    return ctx.fleet


def _described(model: FleetModel) -> dict[str, Any]:
    """SageMaker's model description, with its health (`ready`)."""
    return {"modelName": model.served.name, "modelUrl": model.url, "ready": model.served.ready}


def _refused(error: FleetError) -> Reply:
    kind = ErrorKind.NOT_FOUND if error.status == 404 else ErrorKind.VALIDATION
    return Reply(error.status, DjlManagementError(error.message, kind).payload(error.status))
