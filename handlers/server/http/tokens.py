"""vLLM's tokenizer endpoints over HTTP: `POST /tokenize` and `POST /detokenize`, with OpenAI's
error shape (handlers/protocols/tokens.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from handlers.engine.base import Engine
from handlers.protocols.chat.errors import not_a_text_model
from handlers.protocols.schemas.openai import OpenAIErrorBody
from handlers.protocols.schemas.tokens import DetokenizeAnswer, TokenizeAnswer
from handlers.protocols.tokens import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizePromptRequest,
    detokenize,
    tokenize,
)
from handlers.server.context import ServerContext
from handlers.server.framing import Answer, Reply
from handlers.server.http.answers import to_response
from handlers.server.http.descriptor import JSON, Doc, Protocol, error_bodies
from handlers.server.http.guard import guarded
from handlers.server.http.openai import OPENAI, read_openai


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()

    @routes.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return to_response(await read_openai(ctx, request, tokenize_body))

    @routes.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return to_response(await read_openai(ctx, request, detokenize_body))

    return routes


def _engine(ctx: ServerContext) -> Engine:
    """The generation engine (its tokenizer), or the reason it cannot answer."""
    if ctx.generator is None:
        raise not_a_text_model(ctx.settings.model_name)
    return ctx.generator.ready_engine(OPENAI.refusal)


async def tokenize_body(ctx: ServerContext, request: Request, body: Any) -> Answer:
    async def answer() -> Answer:
        engine = _engine(ctx)
        return Reply(200, await ctx.offload(tokenize, body, engine.tokenizer,
                                            ctx.settings.model_name, engine.max_model_len))

    return await guarded(OPENAI, answer)


async def detokenize_body(ctx: ServerContext, request: Request, body: Any) -> Answer:
    async def answer() -> Answer:
        engine = _engine(ctx)
        return Reply(200, await ctx.offload(detokenize, body, engine.tokenizer,
                                            ctx.settings.model_name))

    return await guarded(OPENAI, answer)


_ERRORS = error_bodies(OpenAIErrorBody, 400, 404, 413, 500, 503)
PROTOCOL = Protocol(router, {
    ("post", "/tokenize"): Doc("vLLM's tokenize: a prompt, or chat messages as chat renders them",
                               TokenizePromptRequest | TokenizeChatRequest,
                               {JSON: TokenizeAnswer}, _ERRORS),
    ("post", "/detokenize"): Doc("vLLM's detokenize", DetokenizeRequest,
                                 {JSON: DetokenizeAnswer}, _ERRORS),
})
