"""Anthropic's Messages API over HTTP: `POST /v1/messages` and `POST /v1/messages/count_tokens`;
`/invocations` bodies in Anthropic's shape reach the same handler (invocations.py says which).

Errors are Anthropic's objects with Anthropic's statuses (`ANTHROPIC_HTTP`). A stream answers 200
only once the first output arrived, so a failure before it gets a status; after that a failure
is an `error` event, as Anthropic's API sends one.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from handlers.engine.base import Engine
from handlers.protocols.anthropic import (
    AnthropicError,
    MessageEvents,
    count_tokens,
    generation_failed,
    messages_checks,
    not_a_text_model,
    prepare_messages,
    render_message,
)
from handlers.server import generation as driver
from handlers.server.context import ServerContext
from handlers.server.framing import Answer, Framing, Reply
from handlers.server.http.answers import disconnect_watch, to_response
from handlers.server.http.guard import HttpProtocol, guarded, read_then
from handlers.server.http.openai import BodyHandler
from handlers.server.status import ANTHROPIC_HTTP

ANTHROPIC = HttpProtocol("Anthropic", ANTHROPIC_HTTP, AnthropicError, generation_failed)


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return to_response(await _read(ctx, request, messages_body))

    @routes.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        return to_response(await _read(ctx, request, count_tokens_body))

    return routes


async def _read(ctx: ServerContext, request: Request, handler: BodyHandler) -> Answer:
    return await read_then(ANTHROPIC, request, ctx.settings.max_request_size,
                           lambda body: handler(ctx, request, body))


def _engine(ctx: ServerContext) -> Engine:
    return ctx.text_engine(ANTHROPIC.refusal, not_a_text_model)


async def messages_body(ctx: ServerContext, request: Request, body: Any) -> Answer:
    async def answer() -> Answer:
        engine = _engine(ctx)
        job = prepare_messages(body, engine.tokenizer, ctx.settings.model_name, engine.adapters)
        generation = ctx.generation(engine, [job.gen], messages_checks(job.chat))
        watch = disconnect_watch(request)
        if job.request.stream:
            renderer = MessageEvents(job.context, ANTHROPIC_HTTP.__getitem__)
            return await driver.stream(generation, renderer, Framing.NAMED_SSE, watch)
        results = await driver.complete(generation, watch)
        return Reply(200, render_message(job.context, results[0]))

    return await guarded(ANTHROPIC, answer)


async def count_tokens_body(ctx: ServerContext, request: Request, body: Any) -> Answer:
    async def answer() -> Answer:
        engine = _engine(ctx)
        return Reply(200, count_tokens(body, engine.tokenizer, ctx.settings.model_name,
                                       engine.adapters))

    return await guarded(ANTHROPIC, answer)
