"""OpenAI's Responses API over HTTP: `POST /v1/responses`, `GET` and `DELETE
/v1/responses/{response_id}`.

A response is generated as a chat completion is: the same body reading, guards (errors in
OpenAI's shape, deadlines, admission limits, client disconnects) and generation driver. A stream
answers 200 once the first output arrived, so a failure before it still gets a status; after it,
a failure is a `response.failed` event. Each event goes as `event: <its type>` and `data:` lines,
and the stream ends without `[DONE]`, as OpenAI sends these streams.
Responses are stored (unless `store` is false) in the app's bounded LRU (`ctx.responses`).

An `/invocations` body with `input` is for the model its caller targets where it targets one
(`/models/{name}/invoke`, `X-Amzn-SageMaker-Target-Model`): embeddings for an embedding model, a
Responses request for a generation model. Otherwise it is a Responses request rather than
embeddings when a generation model is served, its `model` is not an embedding model's name, and:
its `model` is a generation model's name (or one of its LoRA adapters'), or it has a field of
`RESPONSES_FIELDS` (none is an embeddings field), or no embedding model is served. SageMaker's
adapter header stands for the body's `model`.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from fastapi import APIRouter
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response

from handlers.protocols.chat.admit import checks
from handlers.protocols.chat.errors import OpenAIError, not_a_text_model
from handlers.protocols.openai_responses import (
    ResponsesEvents,
    ResponsesJob,
    ResponsesRequest,
    ResponsesStream,
    ResponseStore,
    Stored,
    not_found,
    prepare_response,
)
from handlers.protocols.schemas.openai import OpenAIErrorBody, ResponseDeleted, ResponseObject
from handlers.server import driver
from handlers.server.context import ServerContext
from handlers.server.framing import Answer, Framing, Reply
from handlers.server.http.answers import disconnect_watch, to_response
from handlers.server.http.descriptor import (
    ADAPTER_HEADER,
    JSON,
    SSE,
    SSE_EVENT,
    Body,
    Doc,
    Protocol,
    error_bodies,
)
from handlers.server.http.guard import guarded
from handlers.server.http.openai import ERRORS, OPENAI, read_openai

log = logging.getLogger(__name__)

# Fields of a Responses request that no embeddings request has.
RESPONSES_FIELDS = frozenset({
    "instructions", "max_output_tokens", "previous_response_id", "conversation", "text",
    "tools", "tool_choice", "parallel_tool_calls", "store", "reasoning", "stream",
    "temperature", "top_p", "metadata", "include", "truncation", "background"})


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
        named = body.get("model") if isinstance(body, dict) else None
        engine = ctx.text_engine(OPENAI.refusal, not_a_text_model, named)
        job = await ctx.offload(prepare_response, body, engine.tokenizer,
                                ctx.name_of(engine), store.conversation, engine.adapters,
                                ctx.settings.chat_format(engine))
        if ignored := job.request.ignored_fields:
            log.warning("ignoring unknown fields %s", ignored)
        generation = await ctx.generation(engine, [job.gen], checks(job.chat, lambda _: "input"))
        render = ResponsesStream(job.options)
        keep = functools.partial(_keep, store, job)
        watch = disconnect_watch(request)
        if job.request.stream:
            return await driver.stream(generation, ResponsesEvents(render, keep),
                                       Framing.NAMED_SSE, watch)
        folded = (await driver.complete(generation, watch))[0]
        response = render.whole(folded.sequences[0], folded.prompt_token_count)
        keep(response)
        return Reply(200, response)

    return await guarded(OPENAI, answer)


def _keep(store: ResponseStore, job: ResponsesJob, response: dict[str, Any]) -> None:
    if job.request.store is not False:
        store.put(Stored(response, job.items))


def speaks_responses(ctx: ServerContext, body: dict[str, Any], headers: Headers) -> bool:
    """Whether an /invocations body is a Responses request for the generation model rather
    than embeddings (the module's docstring says when)."""
    if "input" not in body:
        return False
    target = ctx.targeted()
    if target is not None:  # the model decides (one not loaded: the Responses route's 404)
        served = ctx.served(target)
        return served is None or not served.embeds
    if ctx.generator is None:
        return False
    adapter = headers.get(ADAPTER_HEADER)
    model = adapter if adapter is not None else body.get("model")
    loaded = ctx.served(model) if isinstance(model, str) else None
    if loaded is not None and loaded.embeds:
        return False
    return model == ctx.settings.model_name or model in ctx.adapters() or loaded is not None \
        or not RESPONSES_FIELDS.isdisjoint(body) or ctx.embedder is None


CREATE = Doc("OpenAI Responses API", ResponsesRequest, {JSON: ResponseObject, SSE: SSE_EVENT},
             ERRORS)
PROTOCOL = Protocol(router, {
    ("post", "/v1/responses"): CREATE,
    ("get", "/v1/responses/{response_id}"): Doc(
        "A stored response", ok={JSON: ResponseObject},
        errors=error_bodies(OpenAIErrorBody, 400, 404)),
    ("delete", "/v1/responses/{response_id}"): Doc(
        "Delete a stored response", ok={JSON: ResponseDeleted},
        errors=error_bodies(OpenAIErrorBody, 404)),
}, (Body(30, speaks_responses, create_body, CREATE),))
