"""`GET /config`: what the server serves and how it is configured, read-only: the model, the
engine the registry chose, the loaded weights' dtype, device and quantization, the KV cache's
dtype, and every effective setting with where it came from, as startup logs them (the API key
as `<set>`, never its value). Behind the API key, as every route but health; the page's status
reads it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel
from starlette.responses import Response

from handlers.server.context import ServerContext
from handlers.server.framing import Reply
from handlers.server.http.answers import json_response
from handlers.server.http.descriptor import JSON, Doc, Protocol


class SettingValue(BaseModel):
    key: str  # as configured: option.max_model_len, batch_size, --port, ...
    value: str
    source: str  # command line, serving.properties, env <NAME>, default, ...
    note: str = ""  # what it is when not a setting of this server (a DJL front-end key, ...)


class ServerConfiguration(BaseModel):
    model: str
    engine: str | None  # torch, llamacpp or vllm; None on an embeddings-only server
    ready: bool  # as /ping says
    dtype: str | None  # the loaded weights' (None until loaded)
    device: str | None
    quantization: str | None
    # what the engine stores keys and values in, as it chose for option.kv_cache_dtype (None:
    # not loaded, or an engine that does not say: vLLM decides `auto` itself)
    kv_cache_dtype: str | None
    max_model_len: int | None
    embedding_model: str | None
    version: str
    settings: list[SettingValue]


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()

    @routes.get("/config")
    async def configuration() -> Response:
        return json_response(Reply(200, _described(ctx)))

    return routes


def _described(ctx: ServerContext) -> dict[str, Any]:
    settings = ctx.settings
    engine = ctx.generator.engine if ctx.generator is not None else None
    return {
        "model": settings.model_name,
        "engine": settings.engine,
        "ready": ctx.ready(),
        "dtype": None if engine is None else engine.dtype,
        "device": None if engine is None else engine.device,
        "quantization": None if engine is None else engine.quantization,
        "kv_cache_dtype": getattr(engine, "kv_cache_dtype", None),
        "max_model_len": None if engine is None else engine.max_model_len,
        "embedding_model": ctx.embedding_model(),
        "version": settings.server_version,
        "settings": [{"key": line.key, "value": line.value, "source": line.source,
                      "note": line.note} for line in settings.configuration],
    }


PROTOCOL = Protocol(router, {("get", "/config"): Doc(
    "The served model and every effective setting with its source",
    ok={JSON: ServerConfiguration})})
