"""LMI bodies over HTTP (`inputs` / `parameters` / `stream`): rolling batch's schema, or the
dynamic-batch schema under `option.rolling_batch=disable`.

A stream answers 200 only once its first output arrived, so that a failure before it still
gets an error status; after that, a failure ends the stream with LMI's error line.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request

from handlers.engine.base import Engine
from handlers.protocols.lmi import (
    CHECKS,
    LineEvents,
    LmiError,
    RenderOptions,
    TokenEvents,
    answer_style,
    generation_error,
    lmi_adapters,
    parse_lmi_request,
    render_json,
    to_generation_request,
)
from handlers.protocols.lmi.dynamic import (
    DynamicError,
    DynamicRequest,
    parse_dynamic_request,
    render_answer,
    to_generation_requests,
)
from handlers.protocols.lmi.dynamic import checks as dynamic_checks
from handlers.protocols.lmi.request import LmiRequest
from handlers.protocols.outputs import Folded
from handlers.protocols.schemas.lmi import DynamicAnswer, LmiAnswer, LmiErrorBody
from handlers.server import driver
from handlers.server.context import ServerContext
from handlers.server.framing import LMI_FRAMING, Answer, Framing, Reply
from handlers.server.http.answers import disconnect_watch
from handlers.server.http.descriptor import (
    JSON,
    JSONLINES,
    SSE,
    SSE_EVENT,
    STRING,
    Body,
    Doc,
    Protocol,
    error_bodies,
)
from handlers.server.http.guard import HttpProtocol, guarded
from handlers.server.status import LMI_HTTP

log = logging.getLogger(__name__)

LMI = HttpProtocol("LMI", LMI_HTTP, LmiError, generation_error)
DYNAMIC = HttpProtocol("dynamic-batch", LMI_HTTP, DynamicError,
                       lambda error: DynamicError(error.message, error.kind))


async def lmi_body(ctx: ServerContext, request: Request, body: Any) -> Answer:
    """An LMI body's answer, in the schema the server's batching mode serves."""
    async def answer() -> Answer:
        engine = ctx.text_engine(LmiError, _not_a_text_model)
        if ctx.settings.dynamic_batching:
            return await guarded(DYNAMIC, lambda: _dynamic(ctx, engine, request, body))
        return await _rolling(ctx, engine, request, body)

    return await guarded(LMI, answer)


def _not_a_text_model(model: str) -> LmiError:
    return LmiError(f"inputs: '{model}' is an embedding model: this server generates no text "
                    "(option.task=text-embedding); send {\"input\": ...} or use /v1/embeddings")


async def _rolling(ctx: ServerContext, engine: Engine, request: Request, body: Any) -> Answer:
    lmi = parse_lmi_request(body)
    gen = to_generation_request(lmi, lmi_adapters(lmi.adapters, 1, ctx.name_of(engine),
                                                  engine.adapters)[0])
    settings = ctx.settings
    opts = RenderOptions.for_request(lmi, settings.tgi_compat)
    style = answer_style(lmi, settings.output_formatter, settings.tgi_compat)
    log.info("LMI request %s, stream=%s", gen.request_id, lmi.stream)
    generation = await ctx.generation(engine, [gen], CHECKS)
    watch = disconnect_watch(request)
    if style is not None:
        return await driver.stream(generation, TokenEvents(opts, style), LMI_FRAMING[style],
                                   watch)
    folded = Folded()
    await driver.collect(generation, lambda pairs: [folded.add(out) for _, out in pairs], watch)
    return Reply(200, render_json(folded, opts))


async def _dynamic(ctx: ServerContext, engine: Engine, request: Request, body: Any) -> Answer:
    parsed = parse_dynamic_request(body)
    adapters = lmi_adapters(parsed.adapters, len(parsed.inputs), ctx.name_of(engine),
                            engine.adapters, DynamicError)
    gens = to_generation_requests(parsed, adapters)
    log.info("dynamic-batch request with %d inputs", len(gens))
    generation = await ctx.generation(engine, gens, dynamic_checks(parsed))
    watch = disconnect_watch(request)
    if ctx.settings.dynamic_streaming:
        renderer = LineEvents(len(gens), LMI_HTTP.__getitem__)
        return await driver.stream(generation, renderer, Framing.JSONLINES, watch)
    folded = [Folded() for _ in gens]
    await driver.collect(generation, lambda pairs: [folded[i].add(out) for i, out in pairs],
                         watch)
    return Reply(200, render_answer(folded, parsed))


# LMI has no route of its own: it answers what no other protocol on /invocations speaks.
PROTOCOL = Protocol(bodies=(Body(
    100, None, lmi_body,
    Doc("LMI", LmiRequest | DynamicRequest,
        {JSON: LmiAnswer | list[LmiAnswer] | list[DynamicAnswer], JSONLINES: STRING,
         SSE: SSE_EVENT},
        error_bodies(LmiErrorBody, 400, 404, 408, 413, 424, 500, 503)),
    selector="adapters"),))
