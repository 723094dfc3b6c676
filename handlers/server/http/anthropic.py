"""Anthropic's Messages API over HTTP: `POST /v1/messages` and `POST /v1/messages/count_tokens`;
`/invocations` bodies in Anthropic's shape reach the same handler (invocations.py says which).

Errors are Anthropic's objects with Anthropic's statuses (`ANTHROPIC_HTTP`). A stream answers 200
only once the first output arrived, so a failure before it gets a status; after that a failure
is an `error` event, as Anthropic's API sends one.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from handlers.engine.base import Engine, Pair
from handlers.protocols.anthropic import (
    AnthropicError,
    MessageStream,
    count_tokens,
    generation_failed,
    in_anthropic_terms,
    not_a_text_model,
    prepare_messages,
    render_message,
)
from handlers.protocols.errors import GenerationError
from handlers.protocols.openai import admit
from handlers.protocols.outputs import Event, output_failure
from handlers.server.context import ServerContext
from handlers.server.framing import Answer, Framing, Reply, StreamReply
from handlers.server.generation import Generation, complete, first
from handlers.server.http.guard import HttpProtocol, guarded, read_then
from handlers.server.http.openai import BodyHandler
from handlers.server.http.responses import disconnect_watch, to_response
from handlers.server.status import ANTHROPIC_HTTP

log = logging.getLogger(__name__)

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
    """The generation engine, or the reason it cannot answer."""
    if ctx.generator is None:
        raise not_a_text_model(ctx.settings.model_name)
    return ctx.generator.ready_engine(ANTHROPIC.refusal)


async def messages_body(ctx: ServerContext, request: Request, body: Any) -> Answer:
    async def answer() -> Answer:
        engine = _engine(ctx)
        job = prepare_messages(body, engine.tokenizer, ctx.settings.model_name, engine.adapters)
        with in_anthropic_terms():
            admit(engine, job.gen, job.chat, "messages")
        generation = ctx.generation(engine, [job.gen])
        if job.request.stream:
            return await _stream(request, generation, MessageStream(job.context))
        results = await complete(generation, ANTHROPIC.refusal, disconnect_watch(request))
        return Reply(200, render_message(job.context, results[0]))

    return await guarded(ANTHROPIC, answer)


async def count_tokens_body(ctx: ServerContext, request: Request, body: Any) -> Answer:
    async def answer() -> Answer:
        engine = _engine(ctx)
        return Reply(200, count_tokens(body, engine.tokenizer, ctx.settings.model_name,
                                       engine.adapters))

    return await guarded(ANTHROPIC, answer)


async def _stream(request: Request, generation: Generation, stream: MessageStream) -> Answer:
    pairs = await first(generation, lambda pairs: pairs, disconnect_watch(request)) or []
    try:
        opening = _feed(stream, pairs)
    except GenerationError:
        await generation.aclose()
        raise
    return StreamReply(_events(opening, generation, stream), Framing.NAMED_SSE)


def _feed(stream: MessageStream, pairs: list[Pair]) -> list[dict[str, Any]]:
    """The events of some outputs; GenerationError when one failed its request."""
    events = []
    for _, output in pairs:
        if (failure := output_failure(output)) is not None:
            raise GenerationError(failure.message, failure.kind)
        events += stream.feed(output)
    return events


async def _events(opening: list[dict[str, Any]], generation: Generation, stream: MessageStream
                  ) -> AsyncIterator[list[Event]]:
    # One event per chunk: each goes out on its own (a PayloadPart of its own on SageMaker).
    try:
        for event in opening:
            yield [Event(event)]
        async for pairs in generation:
            for event in _feed(stream, pairs):
                yield [Event(event)]
    except GenerationError as exc:
        log.warning("generation failed mid-stream: %s", exc.message)
        error = generation_failed(exc)
        yield [Event(error.payload(ANTHROPIC_HTTP[error.kind]), failure=error.message)]
    finally:
        await generation.aclose()
