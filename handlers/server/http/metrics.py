"""GET /metrics: the server's telemetry (handlers/server/telemetry.py) in Prometheus text format."""

from __future__ import annotations

from fastapi import APIRouter
from prometheus_client import generate_latest
from starlette.responses import Response

from handlers.server.context import ServerContext
from handlers.server.http.descriptor import STRING, TEXT, Doc, Protocol


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()

    @routes.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(ctx.telemetry.registry),
                        media_type="text/plain; version=0.0.4")

    return routes


PROTOCOL = Protocol(router, {("get", "/metrics"): Doc("Prometheus metrics", ok={TEXT: STRING})})
