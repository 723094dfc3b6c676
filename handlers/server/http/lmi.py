"""LMI bodies over HTTP (`inputs` / `parameters` / `stream`): rolling batch's schema, or the
dynamic-batch schema under `option.rolling_batch=disable`.

A stream answers 200 only once its first output arrived, so that a failure before it still
gets an error status; after that, a failure ends the stream with LMI's error line.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from handlers.engine.base import Engine, Pair
from handlers.engine.types import RequestValidationError
from handlers.protocols.errors import GenerationError
from handlers.protocols.lmi import (
    LmiError,
    RenderOptions,
    StreamRenderer,
    answer_style,
    early_failure,
    generation_error,
    lmi_adapter,
    parse_lmi_request,
    render_json,
    to_generation_request,
)
from handlers.protocols.lmi.dynamic import (
    DynamicError,
    StreamLines,
    parse_dynamic_request,
    render_answer,
    to_generation_requests,
    validate_inputs,
)
from handlers.protocols.outputs import Event, Folded
from handlers.server.context import ServerContext
from handlers.server.framing import LMI_FRAMING, Answer, Framing, Reply, StreamReply
from handlers.server.generation import Generation, Watch, collect, first
from handlers.server.http.guard import HttpProtocol, guarded
from handlers.server.http.responses import disconnect_watch
from handlers.server.status import LMI_HTTP

log = logging.getLogger(__name__)

LMI = HttpProtocol("LMI", LMI_HTTP, LmiError, generation_error)
DYNAMIC = HttpProtocol("dynamic-batch", LMI_HTTP, DynamicError,
                       lambda error: DynamicError(error.message, error.kind))


async def lmi_body(ctx: ServerContext, request: Request, body: Any) -> Answer:
    """An LMI body's answer, in the schema the server's batching mode serves."""
    async def answer() -> Answer:
        if ctx.generator is None:
            raise LmiError(f"inputs: '{ctx.settings.model_name}' is an embedding model: this "
                           "server generates no text (option.task=text-embedding); send "
                           "{\"input\": ...} or use /v1/embeddings")
        ctx.generator.ready_engine(LmiError)
        if ctx.settings.dynamic_batching:
            return await guarded(DYNAMIC, lambda: _dynamic(ctx, request, body))
        return await _rolling(ctx, request, body)

    return await guarded(LMI, answer)


# --- rolling batch ------------------------------------------------------------------------------


async def _rolling(ctx: ServerContext, request: Request, body: Any) -> Answer:
    engine: Engine = ctx.generator.engine
    lmi = parse_lmi_request(body)
    gen = to_generation_request(lmi, lmi_adapter(lmi.adapters, ctx.settings.model_name,
                                                 engine.adapters))
    try:
        engine.validate(gen)
    except RequestValidationError as exc:
        raise LmiError(f"{exc.field}: {exc.message}") from None
    settings = ctx.settings
    opts = RenderOptions.for_request(lmi, settings.tgi_compat)
    style = answer_style(lmi, settings.output_formatter, settings.tgi_compat)
    log.info("LMI request %s, stream=%s", gen.request_id, lmi.stream)
    generation = ctx.generation(engine, [gen])
    watch = disconnect_watch(request)
    if style is not None:
        renderer = StreamRenderer(opts, style)
        pairs = await first(generation, lambda pairs: pairs, watch)
        if (failed := early_failure(pairs[0][1])) is not None:
            await generation.aclose()
            raise failed
        return StreamReply(_token_events(renderer, pairs, generation), LMI_FRAMING[style])
    folded = Folded()
    await collect(generation, lambda pairs: [folded.add(output) for _, output in pairs], watch)
    return Reply(200, render_json(folded, opts))


async def _token_events(renderer: StreamRenderer, pairs: list[Pair], generation: Generation
                        ) -> AsyncIterator[list[Event]]:
    try:
        yield [event for _, output in pairs for event in renderer.feed(output)]
        async for pairs in generation:
            yield [event for _, output in pairs for event in renderer.feed(output)]
    except GenerationError as exc:
        log.warning("generation failed mid-stream: %s", exc.message)
        if not renderer.done:
            yield [renderer.error(exc.message)]
    finally:
        await generation.aclose()


# --- dynamic batching ---------------------------------------------------------------------------


async def _dynamic(ctx: ServerContext, request: Request, body: Any) -> Answer:
    parsed = parse_dynamic_request(body)
    adapter = lmi_adapter(parsed.adapters, ctx.settings.model_name,
                          ctx.generator.engine.adapters, DynamicError)
    gens = to_generation_requests(parsed, adapter)
    validate_inputs(parsed, gens, ctx.generator.engine.validate)
    log.info("dynamic-batch request with %d inputs", len(gens))
    generation = ctx.generation(ctx.generator.engine, gens)
    watch = disconnect_watch(request)
    if ctx.settings.dynamic_streaming:
        return await _dynamic_stream(generation, len(gens), watch)
    folded = [Folded() for _ in gens]
    await collect(generation, lambda pairs: [folded[i].add(out) for i, out in pairs], watch)
    return Reply(200, render_answer(folded, parsed))


async def _dynamic_stream(generation: Generation, inputs: int, watch: Watch
                          ) -> Answer:
    """Answers 200 once the batch released text; a failure before that is an error status."""
    lines = StreamLines(inputs)

    def first_line(pairs: list[Pair]) -> list[Event] | None:
        line = lines.feed(pairs)
        return [line] if line else ([] if lines.done else None)

    events = await first(generation, first_line, watch) or []
    if lines.failure is not None and not events:
        await generation.aclose()
        raise DynamicError(lines.failure.message, lines.failure.kind)
    return StreamReply(_line_events(events, lines, generation), Framing.JSONLINES)


async def _line_events(events: list[Event], lines: StreamLines, generation: Generation
                       ) -> AsyncIterator[list[Event]]:
    try:
        yield events
        if not lines.done:
            async for pairs in generation:
                if line := lines.feed(pairs):
                    yield [line]
                if lines.done:
                    break
        if lines.failure is not None:
            yield [lines.error(lines.failure.message, LMI_HTTP[lines.failure.kind])]
    except GenerationError as exc:
        log.warning("generation failed mid-stream: %s", exc.message)
        yield [lines.error(exc.message, LMI_HTTP[exc.kind])]
    finally:
        await generation.aclose()
