"""LoRA adapters managed at runtime over HTTP: DJL Serving's adapter API, under
`/models/{model}/adapters` and, for a single model, `/adapters`; and vLLM's
`POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` (handlers/protocols/
adapter_management.py reads both). An engine with LoRA off refuses a registration before its
source is looked at; a source is read only from the allowed roots, and fetched only where
option.allow_runtime_fetch allows it (handlers/server/adapter_sources.py); the API key guards
these routes as every other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from handlers.config import values
from handlers.engine.base import Engine
from handlers.engine.types import AdapterError
from handlers.protocols.adapter_management import (
    AdapterRecord,
    DjlManagementError,
    LoadLoraAdapter,
    UnloadLoraAdapter,
    page,
    registration,
    update,
    vllm_body,
)
from handlers.protocols.chat.errors import OpenAIError
from handlers.protocols.errors import ErrorKind, ProtocolError
from handlers.protocols.schemas.djl import DjlAdapter, DjlAdapterList, DjlErrorBody, DjlStatus
from handlers.protocols.schemas.openai import OpenAIErrorBody
from handlers.server.adapter_sources import SourceRefused, as_sent, resolve_source
from handlers.server.context import ServerContext
from handlers.server.framing import Answer, Reply
from handlers.server.http.answers import to_response
from handlers.server.http.descriptor import JSON, STRING, TEXT, Doc, Protocol, error_bodies
from handlers.server.http.guard import HttpProtocol, guarded, read_then
from handlers.server.http.openai import OPENAI
from handlers.server.status import HTTP

DJL = HttpProtocol("DJL management", HTTP, lambda message, kind: DjlManagementError(message, kind),
                   lambda failed: DjlManagementError(failed.message, ErrorKind.FAILED))
PREFIXES = ("/models/{model}", "")  # DJL's full paths, and its short form for one model


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()
    for prefix in PREFIXES:
        _djl_routes(routes, ctx, prefix)

    @routes.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return await _vllm(ctx, request, _load)

    @routes.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return await _vllm(ctx, request, _unload)

    return routes


def _djl_routes(routes: APIRouter, ctx: ServerContext, prefix: str) -> None:
    async def answer(request: Request, work) -> Response:
        model = request.path_params.get("model")
        query = dict(request.query_params)
        return to_response(await guarded(DJL, lambda: work(_engine(ctx, model), query)))

    @routes.post(f"{prefix}/adapters")
    async def register(request: Request) -> Response:
        return await answer(request, lambda engine, query: _register(ctx, engine, query))

    @routes.get(f"{prefix}/adapters")
    async def list_adapters(request: Request) -> Response:
        return await answer(request, lambda engine, query: _list(ctx, engine, query))

    @routes.get(f"{prefix}/adapters/{{name}}")
    async def describe(name: str, request: Request) -> Response:
        return await answer(request, lambda engine, _query: _describe(ctx, engine, name))

    @routes.delete(f"{prefix}/adapters/{{name}}")
    async def unregister(name: str, request: Request) -> Response:
        return await answer(request, lambda engine, _query: _unregister(ctx, engine, name))

    @routes.post(f"{prefix}/adapters/{{name}}/update")
    async def update_adapter(name: str, request: Request) -> Response:
        return await answer(request, lambda engine, query: _update(ctx, engine, name, query))


def _engine(ctx: ServerContext, model: str | None) -> Engine:
    served = ctx.generator
    if served is None or (model is not None and model != served.name):
        raise DjlManagementError(f"Model not found: {model}", ErrorKind.NOT_FOUND)
    return served.ready_engine(DJL.refusal)


async def _register(ctx: ServerContext, engine: Engine, query: dict[str, str]) -> Answer:
    wanted = registration(query)
    try:
        values.model_name(wanted.name)  # requests name it in `model` and in URL paths
    except ValueError as exc:
        raise DjlManagementError(f"name={wanted.name!r}: {exc}") from None
    await _add(ctx, engine, wanted.name, wanted.src, DjlManagementError)
    if wanted.pin:
        await _engine_call(engine.pin_adapter(wanted.name, True), DjlManagementError)
    ctx.adapter_records[wanted.name] = AdapterRecord(wanted.name, wanted.src, wanted.pin)
    return Reply(200, {"status": f"Adapter {wanted.name} registered"})


async def _list(ctx: ServerContext, engine: Engine, query: dict[str, str]) -> Answer:
    return Reply(200, page(query, [_record(ctx, name).described() for name in engine.adapters]))


async def _describe(ctx: ServerContext, engine: Engine, name: str) -> Answer:
    _served(engine, name, DjlManagementError)
    return Reply(200, [_record(ctx, name).described()])


async def _unregister(ctx: ServerContext, engine: Engine, name: str) -> Answer:
    await _engine_call(engine.remove_adapter(name), DjlManagementError)
    _forget(ctx, engine, name)
    return Reply(200, {"status": f"Adapter {name} unregistered"})


async def _update(ctx: ServerContext, engine: Engine, name: str, query: dict[str, str]
                  ) -> Answer:
    _served(engine, name, DjlManagementError)
    pin = update(query)
    if pin is not None:
        await _engine_call(engine.pin_adapter(name, pin), DjlManagementError)
        record = _record(ctx, name)
        ctx.adapter_records[name] = AdapterRecord(name, record.src, pin)
    return Reply(200, {"status": f"Adapter {name} updated"})


def _forget(ctx: ServerContext, engine: Engine, name: str) -> None:
    """Adapter `name` of `engine` is gone: its record, and its model.py's code with it (DJL
    unloads an adapter's custom code as it unregisters the adapter)."""
    ctx.adapter_records.pop(name, None)
    own = ctx.generator is not None and engine is ctx.generator.engine
    if own and ctx.entry_code is not None:
        ctx.entry_code.forget_adapter(name)


def _record(ctx: ServerContext, name: str) -> AdapterRecord:
    return ctx.adapter_records.get(name) or AdapterRecord(name, name)


def _served(engine: Engine, name: str, error: type[ProtocolError]) -> None:
    if name not in engine.adapters:
        raise error(f"Adapter {name} not found", ErrorKind.NOT_FOUND)


async def _add(ctx: ServerContext, engine: Engine, name: str, src: str,
               error: type[ProtocolError], field: str = "src") -> None:
    """Serve adapter `src` (the request's `field`) as `name`."""
    if engine.adapter_activity() is None:  # LoRA is off: nothing read, nothing fetched
        raise error("LoRA is off: set option.enable_lora=true to register adapters")
    if name in engine.adapters or name == ctx.settings.model_name:
        raise error(f"The lora adapter '{name}' has already been loaded.")
    settings = ctx.settings
    try:
        path = await ctx.offload(resolve_source, src, settings.adapter_roots, settings.model_dir,
                                 field=field, fetch_allowed=settings.runtime_fetch)
    except SourceRefused as exc:
        raise error(str(exc)) from None
    await _engine_call(engine.add_adapter(name, path), error, lambda m: as_sent(m, path, src))


async def _engine_call(call: Any, error: type[ProtocolError],
                       said: Callable[[str], str] = str) -> None:
    """Await the engine's `call`; its AdapterError as the protocol's `error` (`said`: how its
    message reaches the client)."""
    try:
        await call
    except AdapterError as exc:
        raise error(said(exc.message), ErrorKind.NOT_FOUND if exc.missing else
                    ErrorKind.VALIDATION) from None


# -- vLLM's dialect --------------------------------------------------------------------------------


async def _vllm(ctx: ServerContext, request: Request, work) -> Response:
    async def answer(body: Any) -> Answer:
        engine = ctx.text_engine(OPENAI.refusal, lambda model: OpenAIError(
            f"this server serves no generation model ({model})", kind=ErrorKind.NOT_FOUND))
        return await work(ctx, engine, body)

    answered = await read_then(OPENAI, request, ctx.settings.max_request_size,
                               lambda body: guarded(OPENAI, lambda: answer(body)))
    if isinstance(answered, Reply) and isinstance(answered.content, str):
        return PlainTextResponse(answered.content)  # vLLM's success is text
    return to_response(answered)


def _vllm_error(message: str, kind: ErrorKind = ErrorKind.VALIDATION) -> OpenAIError:
    return OpenAIError(message, kind=kind)


async def _load(ctx: ServerContext, engine: Engine, body: Any) -> Answer:
    wanted: LoadLoraAdapter = vllm_body(LoadLoraAdapter, body, _vllm_error)
    await _add(ctx, engine, wanted.lora_name, wanted.lora_path, _vllm_error, "lora_path")
    ctx.adapter_records[wanted.lora_name] = AdapterRecord(wanted.lora_name, wanted.lora_path)
    return Reply(200, f"Success: LoRA adapter '{wanted.lora_name}' added successfully.")


async def _unload(ctx: ServerContext, engine: Engine, body: Any) -> Answer:
    wanted: UnloadLoraAdapter = vllm_body(UnloadLoraAdapter, body, _vllm_error)
    if wanted.lora_name not in engine.adapters:
        raise _vllm_error(f"The lora adapter '{wanted.lora_name}' cannot be found.",
                          ErrorKind.NOT_FOUND)
    await _engine_call(engine.remove_adapter(wanted.lora_name), _vllm_error)
    _forget(ctx, engine, wanted.lora_name)
    return Reply(200, f"Success: LoRA adapter '{wanted.lora_name}' removed successfully.")


def _parameter(name: str, where: str = "query", required: bool = False,
               kind: str = "string") -> dict[str, Any]:
    return {"name": name, "in": where, "required": required or where == "path",
            "schema": {"type": kind}}


def _docs() -> dict[tuple[str, str], Doc]:
    errors = error_bodies(DjlErrorBody, 400, 404, 503)
    pin = _parameter("pin", kind="boolean")
    preload = _parameter("preload", kind="boolean")
    docs: dict[tuple[str, str], Doc] = {}
    for prefix in PREFIXES:
        model = (_parameter("model", "path"),) if prefix else ()
        named = model  # FastAPI documents `name`: its routes take it
        docs |= {
            ("post", f"{prefix}/adapters"): Doc(
                "DJL: register a LoRA adapter", ok={JSON: DjlStatus}, errors=errors,
                parameters=(*model, _parameter("name", required=True),
                            _parameter("src", required=True), pin, preload)),
            ("get", f"{prefix}/adapters"): Doc(
                "DJL: list the LoRA adapters", ok={JSON: DjlAdapterList}, errors=errors,
                parameters=(*model, _parameter("limit", kind="integer"),
                            _parameter("next_page_token"))),
            ("get", f"{prefix}/adapters/{{name}}"): Doc(
                "DJL: describe a LoRA adapter", ok={JSON: list[DjlAdapter]}, errors=errors,
                parameters=named),
            ("delete", f"{prefix}/adapters/{{name}}"): Doc(
                "DJL: unregister a LoRA adapter", ok={JSON: DjlStatus}, errors=errors,
                parameters=named),
            ("post", f"{prefix}/adapters/{{name}}/update"): Doc(
                "DJL: update a LoRA adapter", ok={JSON: DjlStatus}, errors=errors,
                parameters=(*named, pin, preload)),
        }
    vllm_errors = error_bodies(OpenAIErrorBody, 400, 404, 413, 503)
    return docs | {
        ("post", "/v1/load_lora_adapter"): Doc("vLLM: load a LoRA adapter", LoadLoraAdapter,
                                               {TEXT: STRING}, vllm_errors),
        ("post", "/v1/unload_lora_adapter"): Doc("vLLM: unload a LoRA adapter",
                                                 UnloadLoraAdapter, {TEXT: STRING},
                                                 vllm_errors),
    }


PROTOCOL = Protocol(router, _docs())
