"""Databricks' serving endpoints: `POST /serving-endpoints/{model}/invocations` answers chat,
completions or embeddings, whichever the body asks for and the endpoint's model does, in
OpenAI's shapes. An endpoint named after a LoRA adapter answers with that adapter."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from handlers.protocols.chat.errors import model_not_found
from handlers.protocols.databricks import check_endpoint_task, task_key
from handlers.server.context import ServerContext
from handlers.server.framing import Answer, error_reply
from handlers.server.http.answers import to_response
from handlers.server.http.descriptor import BodyHandler, Protocol, merged
from handlers.server.http.embeddings import EMBEDDINGS, embeddings_body
from handlers.server.http.guard import guarded
from handlers.server.http.openai import (
    CHAT,
    COMPLETIONS,
    OPENAI,
    chat_body,
    completion_body,
    read_openai,
)
from handlers.server.request_ids import target_model

# The task each body key asks for (protocols/databricks.py), and who answers it.
_HANDLERS: dict[str, BodyHandler] = {
    "messages": chat_body, "prompt": completion_body, "input": embeddings_body}


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()

    @routes.post("/serving-endpoints/{model}/invocations")
    async def databricks(model: str, request: Request) -> Response:
        served = ctx.model_names()
        if model not in served and model not in ctx.adapters():
            error = model_not_found(model, ", ".join(served), ctx.adapters())
            return to_response(error_reply(error, OPENAI.table))

        async def endpoint(ctx: ServerContext, request: Request, body: Any) -> Answer:
            async def task() -> Answer:
                key = task_key(body)
                endpoint_model = ctx.served(model)
                embeds = endpoint_model is not None and endpoint_model.embeds
                check_endpoint_task(model, key, model if embeds else None)
                if model in ctx.adapters() and isinstance(body, dict):
                    body["model"] = model  # an adapter's endpoint: its requests run with it
                elif ctx.fleet is not None and model in ctx.fleet.models:
                    target_model(model)  # a model loaded at runtime answers its endpoint
                return await _HANDLERS[key](ctx, request, body)

            return await guarded(OPENAI, task)

        return to_response(await read_openai(ctx, request, endpoint))

    return routes


PROTOCOL = Protocol(router, {("post", "/serving-endpoints/{model}/invocations"): merged(
    "Databricks serving endpoint: chat, completions or embeddings by body",
    [CHAT, COMPLETIONS, EMBEDDINGS])})
