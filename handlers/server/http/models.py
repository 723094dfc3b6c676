"""`GET /v1/models`, which OpenAI and KServe V1 both claim: one object carrying both shapes,
`{"object": "list", "data": [...], "models": [...]}` (CONTRACT.md)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from handlers.server.context import ServerContext
from handlers.server.framing import Reply
from handlers.server.http.responses import json_response


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()

    @routes.get("/v1/models")
    async def list_models() -> Response:
        names = ctx.model_names()
        data = [{"id": name, "object": "model", "created": ctx.created, "owned_by": "lmi-serve"}
                for name in names]
        return json_response(Reply(200, {"object": "list", "data": data, "models": names}))

    return routes
