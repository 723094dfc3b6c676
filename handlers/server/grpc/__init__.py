"""The gRPC wire: KServe V2's `inference.GRPCInferenceService` on `--grpc-port`, served by
grpc.aio on the HTTP server's event loop, over the same context and engines."""

from __future__ import annotations

import asyncio
import logging

import grpc
from tritonclient.grpc import service_pb2_grpc

from handlers.server.context import CUT_GRACE, ServerContext
from handlers.server.grpc.api_key import ApiKeyInterceptor
from handlers.server.grpc.counting import CountingInterceptor
from handlers.server.grpc.decoding import DecodeGuard
from handlers.server.grpc.request_id import RequestIdInterceptor
from handlers.server.grpc.servicer import InferenceServicer

log = logging.getLogger(__name__)


class GrpcServer:
    def __init__(self, ctx: ServerContext, host: str, port: int) -> None:
        limit = ctx.settings.max_request_size  # a larger message: RESOURCE_EXHAUSTED
        key = ctx.settings.api_key
        guard = [ApiKeyInterceptor(key)] if key else []
        self._server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                                ("grpc.max_send_message_length", limit)],
                                       interceptors=[CountingInterceptor(ctx.telemetry), *guard,
                                                     RequestIdInterceptor(ctx.tracing is not None),
                                                     DecodeGuard()])
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(ctx),
                                                                    self._server)
        # In-flight RPCs finish, or are cut at the drain limit as HTTP's requests are.
        self._grace = ctx.settings.timeout_graceful_shutdown + CUT_GRACE
        self._stopped: asyncio.Task | None = None
        self.address = f"{host}:{port}"
        self._port = self._server.add_insecure_port(self.address)  # raises if it cannot bind

    async def start(self) -> None:
        await self._server.start()
        log.info("KServe V2 gRPC (inference.GRPCInferenceService) on %s", self.address)

    async def stop(self) -> None:
        """Refuse new RPCs, let those in flight finish (cut at the drain limit), then end; a
        second call waits for the first."""
        if self._stopped is None:
            self._stopped = asyncio.create_task(self._server.stop(self._grace))
            self._stopped.add_done_callback(lambda _: log.info("KServe V2 gRPC stopped"))
        await self._stopped
