"""The FastAPI app factory: `create_app(context)`, one router per protocol over the server
context, and KServe V2's gRPC server beside it on the same event loop when a gRPC port is set.
Each protocol's module describes itself (`PROTOCOL`: descriptor.py); the app gathers their
routes, their OpenAPI operations and the bodies `/invocations` tells apart. No module-level
app or state; engines are the context's, attached when loaded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from handlers.server.context import ServerContext
from handlers.server.grpc import GrpcServer
from handlers.server.http import (
    adapters,
    anthropic,
    configuration,
    databricks,
    embeddings,
    generate,
    health,
    invocations,
    kserve,
    lmi,
    metrics,
    models,
    multi_model,
    openai,
    openapi,
    responses_api,
    sagemaker,
    sessions,
    tgi,
    tokens,
)
from handlers.server.http.api_key import ApiKeyMiddleware
from handlers.server.http.body import BodyFramingMiddleware
from handlers.server.http.descriptor import Protocol
from handlers.server.http.invocations import Invocations
from handlers.server.http.request_id import RequestIdMiddleware
from handlers.server.request_ids import install_log_ids
from handlers.server.telemetry import RequestCounter
from handlers.server.ui import page

PROTOCOLS: tuple[Protocol, ...] = tuple(module.PROTOCOL for module in (
    health, models, openai, embeddings, databricks, kserve, generate, tgi, metrics,
    responses_api, anthropic, tokens, adapters, sessions, lmi, configuration, page))
EXPIRY_SWEEP_SECONDS = 60  # how often expired stateful sessions are let go at the latest


def served_protocols() -> tuple[Protocol, ...]:
    """Every protocol, and the entries that answer whichever of them a body speaks."""
    entry = Invocations(body for protocol in PROTOCOLS for body in protocol.bodies)
    return (*PROTOCOLS, invocations.protocol(entry), sagemaker.protocol(entry),
            multi_model.protocol(entry))


def create_app(ctx: ServerContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        ctx.loop = asyncio.get_running_loop()  # where engines that live on it start
        settings = ctx.settings
        if settings.grpc_port:
            grpc = GrpcServer(ctx, settings.grpc_host, settings.grpc_port)
            await grpc.start()
            ctx.on_drain(grpc.stop)
        expiry = None if ctx.sessions is None else asyncio.create_task(
            ctx.sessions.expire_every(min(EXPIRY_SWEEP_SECONDS, settings.sessions_expiration)))
        yield
        if expiry is not None:
            expiry.cancel()
        await ctx.drained()  # the HTTP server drained its requests; so does gRPC
        await ctx.shutdown()

    app = FastAPI(title="lmi-serve", docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json", lifespan=lifespan)
    protocols = served_protocols()
    routers = [protocol.router(ctx) for protocol in protocols if protocol.router is not None]
    for routes in routers:
        app.include_router(routes)
    docs = {operation: doc for protocol in protocols for operation, doc in protocol.docs.items()}
    openapi.install(app, ctx.settings.server_version, docs)  # the bodies routes read by hand
    if ctx.settings.enable_ui:
        app.add_middleware(page.PageAtRoot)  # innermost: it routes `GET /` to the page
    if ctx.settings.api_key:
        app.add_middleware(ApiKeyMiddleware, key=ctx.settings.api_key)
    app.add_middleware(BodyFramingMiddleware, timeout=ctx.settings.client_body_timeout)
    # Outside the key check: a 401 carries an id too.
    app.add_middleware(RequestIdMiddleware, trace_headers=ctx.tracing is not None)
    install_log_ids()
    # Outermost, so that answers of the other middlewares are counted too (by the route they
    # would have reached: the routers' own routes, which FastAPI no longer flattens).
    app.add_middleware(RequestCounter, telemetry=ctx.telemetry,
                       routes=[route for routes in routers for route in routes.routes])
    return app
