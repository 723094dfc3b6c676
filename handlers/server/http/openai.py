"""OpenAI's chat completions and completions over HTTP (`POST /v1/chat/completions`,
`POST /v1/completions`); `/invocations` and Databricks' endpoints reach the same handlers.

Bad input never reaches the engine: it is a 400 (404 for another model) in OpenAI's error shape.
Streams answer 200 only once the first output arrived, so a failure before it gets a status;
after that a failure is one more event before `[DONE]`.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from handlers.engine.base import Engine
from handlers.protocols.chat.admit import checks
from handlers.protocols.chat.errors import OpenAIError, generation_failed, not_a_text_model
from handlers.protocols.chat.requests import ChatCompletionRequest, GenerationFields
from handlers.protocols.openai import (
    chat_events,
    completion_events,
    prepare_chat,
    prepare_completion,
    render_chat_completion,
    render_completion,
)
from handlers.protocols.openai.requests import CompletionRequest
from handlers.protocols.schemas.openai import ChatCompletion, Completion, OpenAIErrorBody
from handlers.server import driver
from handlers.server.context import ServerContext
from handlers.server.framing import Answer, Framing, Reply
from handlers.server.http.answers import disconnect_watch, to_response
from handlers.server.http.descriptor import (
    JSON,
    SSE,
    SSE_EVENT,
    Body,
    BodyHandler,
    Doc,
    Protocol,
    error_bodies,
)
from handlers.server.http.guard import HttpProtocol, guarded, read_then
from handlers.server.status import HTTP

log = logging.getLogger(__name__)

OPENAI = HttpProtocol("OpenAI", HTTP, lambda message, kind: OpenAIError(message, kind=kind),
                      generation_failed)
ERRORS = error_bodies(OpenAIErrorBody, 400, 404, 408, 413, 500, 503)


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return to_response(await read_openai(ctx, request, chat_body))

    @routes.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return to_response(await read_openai(ctx, request, completion_body))

    return routes


async def read_openai(ctx: ServerContext, request: Request, handler: BodyHandler) -> Answer:
    """Answer an OpenAI-shaped body with `handler` (an OpenAI error when it cannot be read)."""
    return await read_then(OPENAI, request, ctx.settings.max_request_size,
                           lambda body: handler(ctx, request, body))


def _engine(ctx: ServerContext, body: Any) -> Engine:
    named = body.get("model") if isinstance(body, dict) else None
    return ctx.text_engine(OPENAI.refusal, not_a_text_model, named)


async def chat_body(ctx: ServerContext, request: Request, body: Any) -> Answer:
    async def answer() -> Answer:
        engine = _engine(ctx, body)
        settings = ctx.settings
        job = await ctx.offload(prepare_chat, body, engine.tokenizer, ctx.name_of(engine),
                                settings.chat_format(engine), engine.adapters)
        _warn_ignored(job.request)
        fields = checks(job.request, lambda _: "messages")
        generation = await ctx.generation(engine, [job.gen], fields)
        watch = disconnect_watch(request)
        if job.request.stream:
            renderer = chat_events(job.context, job.options, HTTP.__getitem__)
            return await driver.stream(generation, renderer, Framing.OPENAI_SSE, watch)
        results = await driver.complete(generation, watch)
        return Reply(200, render_chat_completion(job.context, job.options, results[0]))

    return await guarded(OPENAI, answer)


async def completion_body(ctx: ServerContext, request: Request, body: Any) -> Answer:
    async def answer() -> Answer:
        engine = _engine(ctx, body)
        job = await ctx.offload(prepare_completion, body, engine.tokenizer,
                                ctx.name_of(engine), engine.adapters)
        _warn_ignored(job.request)
        one = len(job.gens) == 1
        fields = checks(job.request, lambda i: "prompt" if one else f"prompt[{i}]")
        generation = await ctx.generation(engine, job.gens, fields)
        watch = disconnect_watch(request)
        if job.request.stream:
            renderer = completion_events(job.context, job.options, HTTP.__getitem__)
            return await driver.stream(generation, renderer, Framing.OPENAI_SSE, watch)
        results = await driver.complete(generation, watch)
        return Reply(200, render_completion(job.context, job.options, results))

    return await guarded(OPENAI, answer)


def _warn_ignored(request: GenerationFields) -> None:
    if ignored := request.ignored_fields:
        log.warning("ignoring unknown fields %s", ignored)


CHAT = Doc("OpenAI chat completions", ChatCompletionRequest,
           {JSON: ChatCompletion, SSE: SSE_EVENT}, ERRORS)
COMPLETIONS = Doc("OpenAI completions", CompletionRequest, {JSON: Completion, SSE: SSE_EVENT},
                  ERRORS)
PROTOCOL = Protocol(router, {
    ("post", "/v1/chat/completions"): CHAT,
    ("post", "/v1/completions"): COMPLETIONS,
}, (Body(20, lambda _ctx, body, _headers: "messages" in body, chat_body, CHAT),
    Body(40, lambda _ctx, body, _headers: "prompt" in body, completion_body, COMPLETIONS)))
