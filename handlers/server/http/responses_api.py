"""OpenAI's Responses API over HTTP: `POST /v1/responses`, `GET` and `DELETE
/v1/responses/{response_id}` (not to be confused with `responses.py`, HTTP answers in general).

A response is generated as a chat completion is: the same body reading, guards (errors in
OpenAI's shape, deadlines, admission limits, client disconnects) and generation driver. A stream
answers 200 once the first output arrived, so a failure before it still gets a status; after it,
a failure is a `response.failed` event. Each event goes as `event: <its type>` and `data:` lines,
and the stream ends without `[DONE]`, as OpenAI sends these streams.
Responses are stored (unless `store` is false) in the app's bounded LRU (`ctx.responses`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from handlers.engine.base import Engine, Pair
from handlers.protocols.chat.errors import OpenAIError, generation_failed, not_a_text_model
from handlers.protocols.errors import GenerationError
from handlers.protocols.openai import admit
from handlers.protocols.openai_responses import (
    ResponsesJob,
    ResponsesStream,
    ResponseStore,
    Stored,
    not_found,
    prepare_response,
)
from handlers.protocols.outputs import Event, Folded, output_failure
from handlers.server.context import ServerContext
from handlers.server.framing import Answer, Framing, Reply, StreamReply
from handlers.server.generation import Generation, collect, first
from handlers.server.http.guard import guarded
from handlers.server.http.openai import OPENAI, read_openai
from handlers.server.http.responses import disconnect_watch, to_response

log = logging.getLogger(__name__)

Keep = Callable[[dict[str, Any]], None]  # stores a finished response (or not)


def router(ctx: ServerContext) -> APIRouter:
    store = ctx.responses  # this app's: bounded, in memory
    routes = APIRouter()

    @routes.post("/v1/responses")
    async def create(request: Request) -> Response:
        return to_response(await read_openai(ctx, request, create_body))

    @routes.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> Response:
        async def answer() -> Answer:
            if request.query_params.get("stream", "").lower() in ("true", "1"):
                raise OpenAIError("stream: replaying a stored response's events is not "
                                  "supported", "stream", code="unsupported_parameter")
            stored = store.get(response_id)
            if stored is None:
                raise not_found(response_id)
            return Reply(200, stored.response)

        return to_response(await guarded(OPENAI, answer))

    @routes.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Response:
        async def answer() -> Answer:
            if not store.delete(response_id):
                raise not_found(response_id)
            return Reply(200, {"id": response_id, "object": "response", "deleted": True})

        return to_response(await guarded(OPENAI, answer))

    return routes


async def create_body(ctx: ServerContext, request: Request, body: Any) -> Answer:
    """Answer a Responses body (POST /v1/responses, or /invocations)."""
    store = ctx.responses

    async def answer() -> Answer:
        engine = _engine(ctx)
        job = prepare_response(body, engine.tokenizer, ctx.settings.model_name,
                               store.conversation, engine.adapters)
        if ignored := job.request.ignored_fields:
            log.warning("ignoring unknown fields %s", ignored)
        admit(engine, job.gen, job.chat, "input")
        generation = ctx.generation(engine, [job.gen])
        render = ResponsesStream(job.options)
        keep = functools.partial(_keep, store, job)
        if job.request.stream:
            return await _stream(request, generation, render, keep)
        folded = await _collect(request, generation)
        response = render.whole(folded.sequences[0], folded.prompt_token_count)
        keep(response)
        return Reply(200, response)

    return await guarded(OPENAI, answer)


def _engine(ctx: ServerContext) -> Engine:
    if ctx.generator is None:
        raise not_a_text_model(ctx.settings.model_name)
    return ctx.generator.ready_engine(OPENAI.refusal)


def _keep(store: ResponseStore, job: ResponsesJob, response: dict[str, Any]) -> None:
    if job.request.store is not False:
        store.put(Stored(response, job.items))


def _check(pairs: list[Pair]) -> None:
    for _, output in pairs:
        if (failure := output_failure(output)) is not None:
            raise generation_failed(failure)


async def _collect(request: Request, generation: Generation) -> Folded:
    folded = Folded()

    def fold(pairs: list[Pair]) -> None:
        _check(pairs)
        for _, output in pairs:
            folded.add(output, time.monotonic())

    await collect(generation, fold, disconnect_watch(request))
    return folded


async def _stream(request: Request, generation: Generation, render: ResponsesStream,
                  keep: Keep) -> Answer:
    pairs = await first(generation, lambda pairs: pairs, disconnect_watch(request)) or []
    try:
        _check(pairs)
    except OpenAIError:
        await generation.aclose()
        raise
    return StreamReply(_events(pairs, generation, render, keep), Framing.NAMED_SSE)


async def _events(pairs: list[Pair], generation: Generation, render: ResponsesStream,
                  keep: Keep) -> AsyncIterator[list[Event]]:
    try:
        yield [Event(e) for e in render.start() + _feed(render, pairs)]
        async for more in generation:
            yield [Event(e) for e in _feed(render, more)]
        keep(render.response)
    except GenerationError as exc:
        log.warning("generation failed mid-stream: %s", exc.message)
        yield [Event(e) for e in render.fail(f"generation failed: {exc.message}")]
    finally:
        await generation.aclose()


def _feed(render: ResponsesStream, pairs: list[Pair]) -> list[dict[str, Any]]:
    events = []
    for _, output in pairs:
        if (failure := output_failure(output)) is not None:
            raise GenerationError(failure.message)
        for seq in output.outputs:
            events += render.feed(seq.tokens, seq.finish_reason, output.prompt_token_count,
                                  seq.generated_tokens)
    return events
