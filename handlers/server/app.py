"""The FastAPI app factory: `create_app(context)`, one router per protocol over the server
context, and KServe V2's gRPC server beside it on the same event loop when a gRPC port is set.
No module-level app or state; engines are the context's, attached when loaded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from handlers.server.context import ServerContext
from handlers.server.grpc import GrpcServer
from handlers.server.http import (
    databricks,
    embeddings,
    generate,
    health,
    invocations,
    kserve,
    metrics,
    models,
    openai,
    sagemaker,
    tgi,
)

ROUTERS = (health, invocations, sagemaker, models, openai, embeddings, databricks, kserve,
           generate, tgi, metrics)


def create_app(ctx: ServerContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        ctx.loop = asyncio.get_running_loop()  # where engines that live on it start
        settings = ctx.settings
        if settings.grpc_port:
            grpc = GrpcServer(ctx, settings.grpc_host, settings.grpc_port)
            await grpc.start()
            ctx.on_drain(grpc.stop)
        yield
        await ctx.drained()  # the HTTP server drained its requests; so does gRPC
        await ctx.shutdown()

    app = FastAPI(title="lmi-serve", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    for module in ROUTERS:
        app.include_router(module.router(ctx))
    return app
