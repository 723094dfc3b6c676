"""OpenAI's chat completions and completions over HTTP (`POST /v1/chat/completions`,
`POST /v1/completions`); `/invocations` and Databricks' endpoints reach the same handlers.

Bad input never reaches the engine: it is a 400 (404 for another model) in OpenAI's error shape.
Streams answer 200 only once the first output arrived, so a failure before it gets a status;
after that a failure is one more event before `[DONE]`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from handlers.engine.base import Engine, Pair
from handlers.engine.types import GenerationRequest, RequestOutput
from handlers.protocols.chat.errors import OpenAIError, generation_failed, not_a_text_model
from handlers.protocols.chat.requests import GenerationFields
from handlers.protocols.errors import ErrorKind, GenerationError
from handlers.protocols.openai import (
    ChatStream,
    CompletionStream,
    admit,
    prepare_chat,
    prepare_completion,
    render_chat_completion,
    render_completion,
)
from handlers.protocols.outputs import Event, Folded, output_failure
from handlers.server.context import ServerContext
from handlers.server.framing import Answer, Framing, Reply, StreamReply
from handlers.server.generation import Generation, collect, first
from handlers.server.http.guard import HttpProtocol, guarded, read_then
from handlers.server.http.responses import disconnect_watch, to_response
from handlers.server.status import HTTP

log = logging.getLogger(__name__)

OPENAI = HttpProtocol("OpenAI", HTTP, lambda message, kind: OpenAIError(message, kind=kind),
                      generation_failed)
Feed = Callable[[int, RequestOutput], list[dict[str, Any]]]
BodyHandler = Callable[[ServerContext, Request, Any], Awaitable[Answer]]


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


def _engine(ctx: ServerContext) -> Engine:
    """The generation engine, or the reason it cannot answer."""
    if ctx.generator is None:
        raise not_a_text_model(ctx.settings.model_name)
    return ctx.generator.ready_engine(OPENAI.refusal)


async def chat_body(ctx: ServerContext, request: Request, body: Any) -> Answer:
    async def answer() -> Answer:
        engine = _engine(ctx)
        settings = ctx.settings
        job = prepare_chat(body, engine.tokenizer, settings.model_name,
                           settings.full_text_enabled, engine.adapters)
        _admit(engine, job.gen, job.request, "messages")
        generation = ctx.generation(engine, [job.gen])
        if job.request.stream:
            stream = ChatStream(job.context, job.options)
            return await _stream(request, generation, lambda _, output: stream.feed(output))
        results = await _collect(request, generation, 1)
        return Reply(200, render_chat_completion(job.context, job.options, results[0]))

    return await guarded(OPENAI, answer)


async def completion_body(ctx: ServerContext, request: Request, body: Any) -> Answer:
    async def answer() -> Answer:
        engine = _engine(ctx)
        job = prepare_completion(body, engine.tokenizer, ctx.settings.model_name,
                                 engine.adapters)
        for i, gen in enumerate(job.gens):
            _admit(engine, gen, job.request, "prompt" if len(job.gens) == 1 else f"prompt[{i}]")
        generation = ctx.generation(engine, job.gens)
        if job.request.stream:
            stream = CompletionStream(job.context, job.options)
            return await _stream(request, generation, stream.feed)
        results = await _collect(request, generation, len(job.gens))
        return Reply(200, render_completion(job.context, job.options, results))

    return await guarded(OPENAI, answer)


def _admit(engine: Engine, gen: GenerationRequest, request: GenerationFields,
           prompt_field: str) -> None:
    if ignored := request.ignored_fields:
        log.warning("ignoring unknown fields %s", ignored)
    admit(engine, gen, request, prompt_field)


def _check(pairs: list[Pair]) -> list[Pair]:
    """The outputs, or the failure of the first one that failed its request."""
    for _, output in pairs:
        if (failure := output_failure(output)) is not None:
            raise generation_failed(failure)
    return pairs


async def _collect(request: Request, generation: Generation, prompts: int) -> list[Folded]:
    results = [Folded() for _ in range(prompts)]

    def fold(pairs: list[Pair]) -> None:
        now = time.monotonic()
        for i, output in _check(pairs):
            results[i].add(output, now)

    await collect(generation, fold, disconnect_watch(request))
    return results


async def _stream(request: Request, generation: Generation, feed: Feed) -> Answer:
    pairs = await first(generation, lambda pairs: pairs, disconnect_watch(request))
    try:
        _check(pairs)
    except OpenAIError:
        await generation.aclose()
        raise
    return StreamReply(_chunk_events(pairs, generation, feed), Framing.OPENAI_SSE)


async def _chunk_events(pairs: list[Pair], generation: Generation, feed: Feed
                        ) -> AsyncIterator[list[Event]]:
    # One chunk per event: each goes out on its own (a PayloadPart of its own on SageMaker).
    try:
        for i, output in pairs:
            for chunk in feed(i, output):
                yield [Event(chunk)]
        async for pairs in generation:
            for i, output in pairs:
                if (failure := output_failure(output)) is not None:
                    raise GenerationError(failure.message)
                for chunk in feed(i, output):
                    yield [Event(chunk)]
    except GenerationError as exc:
        log.warning("generation failed mid-stream: %s", exc.message)
        error = OpenAIError(f"generation failed: {exc.message}", kind=ErrorKind.FAILED)
        yield [Event(error.payload(HTTP[error.kind]))]
    finally:
        await generation.aclose()
