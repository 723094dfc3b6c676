"""Serves one LMI-schema request: parse, validate, generate, and answer in the chosen format."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from handlers.engine.base import Engine
from handlers.engine.types import GenerationRequest, RequestOutput, RequestValidationError
from handlers.protocols.lmi import (
    Accumulator,
    LmiError,
    RenderOptions,
    StreamRenderer,
    StreamStyle,
    early_failure,
    error_body,
    parse_lmi_request,
    render_json,
    stream_style,
    to_generation_request,
)
from handlers.protocols.lmi.formatters import JSON_MEDIA_TYPE
from handlers.server.responses import GONE
from handlers.server.streaming import (
    ClientDisconnected,
    ClosingStreamingResponse,
    cancel_generation,
    until_disconnect,
)

log = logging.getLogger(__name__)



def describe(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


def lmi_error(error: LmiError) -> Response:
    return Response(error.body(), error.status, media_type=JSON_MEDIA_TYPE)


def failed_generation(message: str) -> Response:
    return Response(error_body(message, 424), 424, media_type=JSON_MEDIA_TYPE)


class LmiHandler:
    """Answers `/invocations` and `/predictions/{m}` bodies in the LMI schema."""

    def __init__(self, engine: Engine, output_formatter: str, tgi_compat: bool) -> None:
        self.engine = engine
        self.tgi_compat = tgi_compat
        self.style = stream_style(output_formatter, tgi_compat)

    async def __call__(self, request: Request, body: Any, rid: str) -> Response:
        try:
            lmi = parse_lmi_request(body)
            gen = to_generation_request(lmi)
            self.engine.validate(gen)
        except LmiError as exc:
            log.info("[RequestId=%s] invalid LMI request: %s", rid, exc.message)
            return lmi_error(exc)
        except RequestValidationError as exc:
            log.info("[RequestId=%s] engine refused the request: %s", rid, exc.message)
            return lmi_error(LmiError(f"{exc.field}: {exc.message}"))
        opts = RenderOptions.for_request(lmi, self.tgi_compat)
        log.info("[RequestId=%s] LMI request %s, stream=%s", rid, gen.request_id, lmi.stream)
        if lmi.stream and self.style is not None:
            return await self._stream(request, gen, opts, self.style, rid)
        return await self._complete(request, gen, opts, rid)

    async def _complete(
        self, request: Request, gen: GenerationRequest, opts: RenderOptions, rid: str
    ) -> Response:
        acc = Accumulator()
        try:
            await until_disconnect(request, lambda: self._collect(gen, acc))
        except ClientDisconnected:
            log.info("[RequestId=%s] client disconnected; request aborted", rid)
            return Response(status_code=GONE)
        except Exception as exc:
            log.exception("[RequestId=%s] generation failed", rid)
            return failed_generation(describe(exc))
        status, body = render_json(acc, opts)
        return Response(body, status, media_type=JSON_MEDIA_TYPE)

    async def _collect(self, gen: GenerationRequest, acc: Accumulator) -> None:
        stream = self.engine.generate(gen)
        try:
            async for output in stream:
                acc.add(output)
        finally:
            if not acc.finished:
                await cancel_generation(self.engine, stream, gen.request_id)

    async def _stream(
        self,
        request: Request,
        gen: GenerationRequest,
        opts: RenderOptions,
        style: StreamStyle,
        rid: str,
    ) -> Response:
        """Answers 200 once the first output arrives; errors before it get an HTTP status."""
        stream = self.engine.generate(gen)
        try:
            first = await until_disconnect(request, lambda: anext(stream, None))
        except ClientDisconnected:
            await cancel_generation(self.engine, stream, gen.request_id)
            log.info("[RequestId=%s] client disconnected; request aborted", rid)
            return Response(status_code=GONE)
        except Exception as exc:
            await cancel_generation(self.engine, stream, gen.request_id)
            log.exception("[RequestId=%s] generation failed", rid)
            return failed_generation(describe(exc))
        if first is None:
            return failed_generation("the engine ended the request without output")
        failed = early_failure(first)
        if failed is not None:
            return Response(failed[1], failed[0], media_type=JSON_MEDIA_TYPE)
        body = self._stream_body(first, stream, StreamRenderer(opts, style), gen, rid)
        return ClosingStreamingResponse(body, media_type=style.media_type)

    async def _stream_body(
        self,
        first: RequestOutput,
        stream: AsyncIterator[RequestOutput],
        renderer: StreamRenderer,
        gen: GenerationRequest,
        rid: str,
    ) -> AsyncIterator[bytes]:
        finished = first.finished
        try:
            if chunk := renderer.feed(first):
                yield chunk
            async for output in stream:
                finished = finished or output.finished
                if chunk := renderer.feed(output):
                    yield chunk
            if not renderer.done:
                yield renderer.error("the engine ended the request without finishing it")
        except Exception as exc:
            log.exception("[RequestId=%s] generation failed mid-stream", rid)
            if not renderer.done:
                yield renderer.error(describe(exc))
        finally:
            if not finished:
                log.info("[RequestId=%s] stream ended early; request aborted", rid)
                await cancel_generation(self.engine, stream, gen.request_id)
