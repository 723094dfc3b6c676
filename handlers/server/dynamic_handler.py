"""Serves one LMI dynamic-batch request (`option.rolling_batch=disable`): parse, validate, queue
it as one job of the StaticBatcher, and answer a JSON list or, with `option.enable_streaming`,
a jsonlines stream."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response

from handlers.engine.static_batcher import JobStream, StaticBatcher
from handlers.engine.types import GenerationRequest, RequestValidationError
from handlers.protocols.lmi.accumulator import Accumulator
from handlers.protocols.lmi.dynamic import (
    DynamicRequest,
    StreamLines,
    collect,
    error_body,
    input_field,
    parse_dynamic_request,
    render_answer,
    to_generation_requests,
)
from handlers.protocols.lmi.errors import LmiError
from handlers.protocols.lmi.formatters import JSON_MEDIA_TYPE, JSONLINES_MEDIA_TYPE
from handlers.server.responses import GONE
from handlers.server.streaming import ClientDisconnected, ClosingStreamingResponse, until_disconnect

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DynamicBatching:
    """The server's dynamic-batch settings (`batch_size`, `max_batch_delay` in ms)."""

    batch_size: int = 1
    max_batch_delay_ms: int = 100
    streaming: bool = False  # option.enable_streaming


def failure(message: str, status: int = 424) -> Response:
    return Response(error_body(message, status), status, media_type=JSON_MEDIA_TYPE)


def describe(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


async def close(stream: JobStream) -> None:
    with anyio.CancelScope(shield=True):  # runs even while a disconnect cancels the caller
        await stream.aclose()


class DynamicHandler:
    """Answers `/invocations` and `/predictions/{m}` bodies in the dynamic-batch schema."""

    def __init__(self, batcher: StaticBatcher, streaming: bool) -> None:
        self.batcher = batcher
        self.streaming = streaming

    async def __call__(self, request: Request, body: Any, rid: str) -> Response:
        try:
            parsed = parse_dynamic_request(body)
            gens = to_generation_requests(parsed)
            self._validate(parsed, gens)
        except LmiError as exc:
            log.info("[RequestId=%s] invalid request: %s", rid, exc.message)
            return failure(exc.message, exc.status)
        log.info("[RequestId=%s] dynamic-batch request with %d inputs", rid, len(gens))
        stream = self.batcher.submit(gens)
        if self.streaming:
            return await self._stream(request, stream, len(gens), rid)
        return await self._complete(request, stream, parsed, rid)

    def _validate(self, parsed: DynamicRequest, gens: list[GenerationRequest]) -> None:
        for index, gen in enumerate(gens):
            try:
                self.batcher.validate(gen)
            except RequestValidationError as exc:
                where = input_field(parsed, index) if exc.field == "inputs" else exc.field
                raise LmiError(f"{where}: {exc.message}") from None

    async def _complete(
        self, request: Request, stream: JobStream, parsed: DynamicRequest, rid: str
    ) -> Response:
        accumulators = [Accumulator() for _ in parsed.inputs]

        async def gather() -> None:
            async for pairs in stream:
                collect(accumulators, pairs)

        try:
            await until_disconnect(request, gather)
        except ClientDisconnected:
            log.info("[RequestId=%s] client disconnected; request aborted", rid)
            return Response(status_code=GONE)
        except Exception as exc:
            log.exception("[RequestId=%s] generation failed", rid)
            return failure(describe(exc))
        finally:
            await close(stream)
        status, content = render_answer(accumulators, parsed)
        return Response(content, status, media_type=JSON_MEDIA_TYPE)

    async def _stream(self, request: Request, stream: JobStream, inputs: int, rid: str) -> Response:
        """Answers 200 once the batch released text; a failure before that is an HTTP 424."""
        lines = StreamLines(inputs)
        try:
            first = await until_disconnect(request, lambda: self._first_line(stream, lines))
        except ClientDisconnected:
            await close(stream)
            log.info("[RequestId=%s] client disconnected; request aborted", rid)
            return Response(status_code=GONE)
        except Exception as exc:
            await close(stream)
            log.exception("[RequestId=%s] generation failed", rid)
            return failure(describe(exc))
        if lines.failure is not None and not first:
            await close(stream)
            return failure(lines.failure)
        body = self._body(first, stream, lines, rid)
        return ClosingStreamingResponse(body, media_type=JSONLINES_MEDIA_TYPE)

    @staticmethod
    async def _first_line(stream: JobStream, lines: StreamLines) -> bytes:
        """The first non-empty line, or b"" when the job failed or ended before any text."""
        async for pairs in stream:
            if line := lines.feed(pairs):
                return line
            if lines.done:
                break
        return b""

    async def _body(
        self, first: bytes, stream: JobStream, lines: StreamLines, rid: str
    ) -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            if not lines.done:
                async for pairs in stream:
                    if line := lines.feed(pairs):
                        yield line
                    if lines.done:
                        break
            if lines.failure is not None:
                yield lines.error(lines.failure)
            elif not lines.done:
                yield lines.error("the engine ended the request without finishing it")
        except Exception as exc:
            log.exception("[RequestId=%s] generation failed mid-stream", rid)
            yield lines.error(describe(exc))
        finally:
            await close(stream)
