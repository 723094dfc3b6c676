"""`GET /v1/models`, which OpenAI and KServe V1 both claim: one object carrying both shapes,
`{"object": "list", "data": [...], "models": [...]}` (CONTRACT.md). Each LoRA adapter is an
OpenAI model of its own, its `parent` the base model, as vLLM lists them; KServe's `models`
names the models its routes serve."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.responses import Response

from handlers.protocols.schemas.openai import ModelList
from handlers.server.context import ServerContext
from handlers.server.framing import Reply
from handlers.server.http.answers import json_response
from handlers.server.http.descriptor import JSON, Doc, Protocol


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()

    @routes.get("/v1/models")
    async def list_models() -> Response:
        names = ctx.model_names()
        return json_response(Reply(200, {"object": "list", "data": _cards(ctx, names),
                                         "models": names}))

    return routes


def _cards(ctx: ServerContext, names: list[str]) -> list[dict[str, Any]]:
    cards = []
    for name in names:
        cards.append(_card(ctx, name))
        if ctx.generator is not None and name == ctx.generator.name:
            cards += [_card(ctx, adapter) | {"parent": name} for adapter in ctx.adapters()]
    return cards


def _card(ctx: ServerContext, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": ctx.created, "owned_by": "lmi-serve"}


PROTOCOL = Protocol(router, {
    ("get", "/v1/models"): Doc("OpenAI's and KServe V1's model list", ok={JSON: ModelList})})
