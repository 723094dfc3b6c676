"""`GET /ping`: 200 `{"status": "Healthy"}` while every served model can answer, else 503."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from handlers.protocols.schemas.sagemaker import Health
from handlers.server.context import ServerContext
from handlers.server.framing import Reply
from handlers.server.http.answers import json_response
from handlers.server.http.descriptor import JSON, Doc, Protocol


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()

    @routes.get("/ping")
    async def ping() -> Response:
        if ctx.ready():
            return json_response(Reply(200, {"status": "Healthy"}))
        return json_response(Reply(503, {"status": "Unhealthy"}))

    return routes


PROTOCOL = Protocol(router, {("get", "/ping"): Doc(
    "SageMaker health: 200 once every served model can answer", ok={JSON: Health},
    errors={503: Health})})
