"""Anthropic's Messages API over HTTP: `POST /v1/messages` and `POST /v1/messages/count_tokens`;
`/invocations` bodies in Anthropic's shape reach the same handler: those with `messages` that
say they are Anthropic's, by the `anthropic-version` header (every Anthropic SDK sends it), an
`anthropic_version` field (as Bedrock and Vertex AI bodies carry), a top-level `system`, or a
content block of type `tool_use` or `tool_result` (an OpenAI chat body has none of these).

Errors are Anthropic's objects with Anthropic's statuses (`ANTHROPIC_HTTP`). A stream answers 200
only once the first output arrived, so a failure before it gets a status; after that a failure
is an `error` event, as Anthropic's API sends one.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response

from handlers.engine.base import Engine
from handlers.protocols.anthropic import (
    VERSION_HEADER,
    AnthropicError,
    MessageEvents,
    count_tokens,
    generation_failed,
    messages_checks,
    not_a_text_model,
    prepare_messages,
    render_message,
)
from handlers.protocols.anthropic.requests import CountTokensRequest, MessagesRequest
from handlers.protocols.errors import ErrorKind
from handlers.protocols.schemas.anthropic import AnthropicErrorBody, AnthropicMessage, InputTokens
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
from handlers.server.status import HTTP, Table

# Anthropic: 504 timeout_error, 529 overloaded_error (the anthropic SDK's OverloadedError).
ANTHROPIC_HTTP: Table[ErrorKind, int] = Table(
    {**HTTP, ErrorKind.TIMEOUT: 504, ErrorKind.OVERLOADED: 529})
ANTHROPIC = HttpProtocol("Anthropic", ANTHROPIC_HTTP, AnthropicError, generation_failed)
ANTHROPIC_ONLY_BLOCKS = frozenset({"tool_use", "tool_result"})


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


def _engine(ctx: ServerContext, body: Any) -> Engine:
    named = body.get("model") if isinstance(body, dict) else None
    return ctx.text_engine(ANTHROPIC.refusal, not_a_text_model, named)


async def messages_body(ctx: ServerContext, request: Request, body: Any) -> Answer:
    async def answer() -> Answer:
        engine = _engine(ctx, body)
        job = await ctx.offload(prepare_messages, body, engine.tokenizer,
                                ctx.name_of(engine), engine.adapters,
                                ctx.settings.chat_format(engine))
        generation = await ctx.generation(engine, [job.gen], messages_checks(job.chat))
        watch = disconnect_watch(request)
        if job.request.stream:
            renderer = MessageEvents(job.context, ANTHROPIC_HTTP.__getitem__)
            return await driver.stream(generation, renderer, Framing.NAMED_SSE, watch)
        results = await driver.complete(generation, watch)
        return Reply(200, render_message(job.context, results[0]))

    return await guarded(ANTHROPIC, answer)


async def count_tokens_body(ctx: ServerContext, request: Request, body: Any) -> Answer:
    async def answer() -> Answer:
        engine = _engine(ctx, body)
        return Reply(200, await ctx.offload(count_tokens, body, engine.tokenizer,
                                            ctx.name_of(engine), engine.max_model_len,
                                            engine.adapters))

    return await guarded(ANTHROPIC, answer)


def speaks_anthropic(_ctx: ServerContext, body: dict[str, Any], headers: Headers) -> bool:
    """Whether an /invocations body is Anthropic's Messages (the module's docstring says when)."""
    return "messages" in body and (
        VERSION_HEADER in headers or "anthropic_version" in body or "system" in body
        or _has_anthropic_blocks(body["messages"]))


def _has_anthropic_blocks(messages: Any) -> bool:
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
                isinstance(block, dict) and isinstance(block.get("type"), str)
                and block["type"] in ANTHROPIC_ONLY_BLOCKS for block in content):
            return True
    return False


MESSAGES = Doc("Anthropic Messages", MessagesRequest, {JSON: AnthropicMessage, SSE: SSE_EVENT},
               error_bodies(AnthropicErrorBody, 400, 404, 413, 500, 503, 504, 529))
PROTOCOL = Protocol(router, {
    ("post", "/v1/messages"): MESSAGES,
    ("post", "/v1/messages/count_tokens"): Doc(
        "Anthropic Messages: the prompt's tokens", CountTokensRequest, {JSON: InputTokens},
        error_bodies(AnthropicErrorBody, 400, 404, 413, 500, 503)),
}, (Body(10, speaks_anthropic, messages_body, MESSAGES),))
