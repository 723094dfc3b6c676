"""OpenAI's embeddings over HTTP (`POST /v1/embeddings`); `/invocations` bodies with `input`
and Databricks' embedding endpoints reach the same handler. The embedding model loads next to
the LLM; until it is attached its requests answer 503. An embedding model loaded at runtime
(`POST /models`) answers when the body's `model` names it or the caller targets it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from handlers.engine.base import Embedder
from handlers.engine.types import RequestValidationError
from handlers.protocols.chat.errors import OpenAIError, model_not_found
from handlers.protocols.errors import ErrorKind
from handlers.protocols.openai.embeddings import (
    EmbeddingRequest,
    parse_embedding_request,
    render_embeddings,
)
from handlers.protocols.schemas.openai import EmbeddingList, OpenAIErrorBody
from handlers.server.context import ServerContext
from handlers.server.framing import Answer, Reply
from handlers.server.http.answers import to_response
from handlers.server.http.descriptor import JSON, Body, Doc, Protocol, error_bodies
from handlers.server.http.guard import guarded
from handlers.server.http.openai import OPENAI, read_openai


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return to_response(await read_openai(ctx, request, embeddings_body))

    return routes


async def embeddings_body(ctx: ServerContext, request: Request, body: Any) -> Answer:
    async def answer() -> Answer:
        named = body.get("model") if isinstance(body, dict) else None
        served = ctx.embedding_model_for(OPENAI.refusal, named)
        if served is None:
            raise OpenAIError("this server serves no embedding model (option.embedding_model_id)",
                              "model", ErrorKind.NOT_FOUND)
        await served.loaded()
        if not served.ready:
            raise OpenAIError(f"the embedding model is {served.unavailable()}", "model",
                              ErrorKind.UNAVAILABLE)
        engine: Embedder = served.engine
        parsed = parse_embedding_request(body, engine.dimension)
        if parsed.model is not None and parsed.model != engine.model_name:
            raise model_not_found(parsed.model, engine.model_name)
        try:
            result = await engine.embed(parsed.texts, parsed.instruction, truncate=True)
        except RequestValidationError as exc:
            raise OpenAIError(exc.message, exc.field) from None
        return Reply(200, render_embeddings(result.vectors, result.prompt_tokens,
                                            engine.model_name, parsed.encoding_format))

    return await guarded(OPENAI, answer)


EMBEDDINGS = Doc("OpenAI embeddings", EmbeddingRequest, {JSON: EmbeddingList},
                 error_bodies(OpenAIErrorBody, 400, 404, 413, 500, 503))
PROTOCOL = Protocol(router, {("post", "/v1/embeddings"): EMBEDDINGS},
                    (Body(50, lambda _ctx, body, _headers: "input" in body, embeddings_body,
                          EMBEDDINGS),))
