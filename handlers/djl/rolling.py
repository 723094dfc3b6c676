"""DJL's rolling-batch contract, one engine step per `handle()` call.

DJL's front end sends the whole active batch on every call: the requests already running come
first, in the order they joined, with empty data; new requests follow with their bodies. Each
call runs one engine step and answers one binary-encoded record per batch entry, in batch order,
as DJL's own LMI handlers do (djl_python.utils.rolling_batch_inference): `data` (the text to
append to that request's response), `last`, `content_type`, `request_id` and, for a failed
request, `error` and `code`; a request refused before admission gets DJL's parse-failure record
at once and never enters the batch. Bodies and stream lines are JSON as DJL's output formatters
write it (`json.dumps`, non-ASCII kept), so the bytes match DJL's for the same tokens. DJL drops
the requests whose record was `last` before the next call, and so does this driver.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from djl_python.inputs import Input
from djl_python.outputs import Output

from handlers.djl.inputs import request_body, requested_adapter
from handlers.engine.base import SteppableEngine
from handlers.engine.types import RequestOutput
from handlers.protocols.lmi import (
    CHECKS,
    LmiError,
    LmiFailure,
    LmiRequest,
    RenderOptions,
    StreamRenderer,
    StreamStyle,
    answer_style,
    lmi_adapters,
    parse_lmi_request,
    render_json,
    to_generation_request,
)
from handlers.protocols.outputs import UNFINISHED, Folded
from handlers.server.driver import validated
from handlers.server.framing import JSON_MEDIA_TYPE, LMI_FRAMING
from handlers.server.status import LMI_HTTP

log = logging.getLogger(__name__)

# DJL's prefix for a request its input parser refuses (djl_python.input_parser).
_PARSE_FAILED = "Input Parsing failed. Ensure that the request payload is valid. "
# What DJL's Python engine answers 507 for (djl_python.python_sync_engine).
_OUT_OF_MEMORY = ("OutOfMemoryError", "MemoryError")


@dataclass
class _Request:
    """One request of DJL's batch, from its arrival to its last record."""

    client_id: str | None  # DJL's requestId, for logs and the requestId property
    request_id: str = ""  # the engine's id
    opts: RenderOptions | None = None
    renderer: StreamRenderer | None = None  # set when the answer is streamed
    style: StreamStyle | None = None  # the stream's
    acc: Folded = field(default_factory=Folded)
    refusal: str | None = None  # why it was refused before admission
    sent: bool = False  # whether any data went out already
    done: bool = False

    @property
    def content_type(self) -> str:
        return JSON_MEDIA_TYPE if self.style is None else LMI_FRAMING[self.style].media_type

    def record(self, data: str, last: bool = False, **failure: Any) -> dict[str, Any]:
        """The record DJL's RollingBatch.postprocess_results writes (`error` before `code`)."""
        self.done = last
        return {"data": data, "last": last, "content_type": self.content_type,
                "request_id": self.client_id, **failure}

    def failed(self, message: str, status: int) -> dict[str, Any]:
        return self.record("", True, error=message, code=status)


def _refusal_record(message: str) -> dict[str, Any]:
    """DJL's record for a request its parser refused (no content type, no request id)."""
    return {"data": "", "last": True, "code": 424, "error": message}


def _frame(style: StreamStyle, line: Any) -> str:
    """A stream line as DJL's formatters write it (jsonlines, or SSE for sse and tgi_compat)."""
    text = json.dumps(line, ensure_ascii=False) + "\n"
    return text if style is StreamStyle.JSONLINES else f"data: {text}\n"


class RollingBatchDriver:
    def __init__(self, engine: SteppableEngine, output_formatter: str | None,
                 tgi_compat: bool) -> None:
        self.engine = engine
        self.output_formatter = output_formatter
        self.tgi_compat = tgi_compat
        self.running: list[_Request] = []  # in DJL's batch order

    def reset(self) -> None:
        """Forget every request (DJL lost its batch after a failure): free their slots."""
        for req in self.running:
            self.engine.cancel(req.request_id)
        self.running = []

    def inference(self, inputs: Input) -> Output:
        if inputs.get_property("reset_rollingbatch"):
            self.reset()
        batch = inputs.get_batches()
        if len(batch) < len(self.running):  # DJL and this driver disagree: start over
            message = f"DJL sent {len(batch)} requests, but {len(self.running)} are running"
            self.reset()
            raise RuntimeError(message)
        entries = self.running + [self._admit(item) for item in batch[len(self.running) :]]
        self.running = [req for req in entries if req.refusal is None]
        try:
            outputs = self.engine.step() if self.engine.has_work else []
        except Exception as exc:  # the batch state is lost: fail everyone, as DJL's batchers do
            log.exception("rolling batch step failed; %d requests fail", len(self.running))
            self.reset()
            return _encode([self._failed(req, exc) for req in entries])
        by_id: dict[str, list[RequestOutput]] = {}
        for out in outputs:
            by_id.setdefault(out.request_id, []).append(out)
        records = [self._answer(req, by_id.get(req.request_id, [])) for req in entries]
        self.running = [req for req in self.running if not req.done]
        return _encode(records)

    # -- admission ------------------------------------------------------------------------------

    def _admit(self, item: Input) -> _Request:
        req = _Request(client_id=item.get_property("requestId"))
        try:
            lmi = _parse(item)
            style = answer_style(lmi, self.output_formatter, self.tgi_compat)
            named = requested_adapter(item) or lmi.adapters
            adapter = lmi_adapters(named, 1, self.engine.model_name, self.engine.adapters)[0]
            gen = to_generation_request(lmi, adapter)
        except LmiError as exc:
            req.refusal = _PARSE_FAILED + exc.message
        else:
            try:
                gen = validated(self.engine, [gen], CHECKS)[0]
            except LmiError as exc:
                req.refusal = exc.message
        if req.refusal is not None:
            log.info("[RequestId=%s] invalid LMI request: %s", req.client_id, req.refusal)
            return req
        req.request_id = gen.request_id
        req.opts = RenderOptions.for_request(lmi, self.tgi_compat)
        if style is not None:
            req.renderer = StreamRenderer(req.opts, style)
            req.style = style
        self.engine.add(gen)
        log.info("[RequestId=%s] LMI request %s joins the batch, stream=%s",
                 req.client_id, gen.request_id, req.renderer is not None)
        return req

    # -- records --------------------------------------------------------------------------------

    def _answer(self, req: _Request, outputs: list[RequestOutput]) -> dict[str, Any]:
        if req.refusal is not None:
            return _refusal_record(req.refusal)
        if req.renderer is not None:
            return self._stream_record(req, req.renderer, outputs)
        for out in outputs:
            req.acc.add(out)
        if not req.acc.finished:
            return req.record("")
        try:
            body = render_json(req.acc, req.opts)
        except LmiFailure as failed:
            return req.failed(failed.message, LMI_HTTP[failed.kind])
        return req.record(json.dumps(body, ensure_ascii=False), last=True)

    def _stream_record(self, req: _Request, renderer: StreamRenderer,
                       outputs: list[RequestOutput]) -> dict[str, Any]:
        events = [event for out in outputs for event in renderer.feed(out)]
        if any(out.finished for out in outputs) and not renderer.done:
            events.append(renderer.error(UNFINISHED))
        if renderer.done and not req.sent:
            failure = renderer.acc.failure()
            if failure is not None:  # nothing went out yet: DJL can still answer an HTTP error
                return req.failed(failure.message, LMI_HTTP[failure.kind])
        chunk = "".join(_frame(req.style, event.data) for event in events)
        req.sent = req.sent or bool(chunk)
        return req.record(chunk, last=renderer.done)

    def _failed(self, req: _Request, exc: Exception) -> dict[str, Any]:
        """A request's record when the step failed: a stream that began ends with DJL LMI's
        error line; anything else gets an HTTP error, 507 when memory ran out."""
        if req.refusal is not None:
            return _refusal_record(req.refusal)
        message = f"rolling batch inference failed: {exc}"
        if req.renderer is not None and req.sent:
            return req.record(_frame(req.style, req.renderer.error(message).data), last=True)
        return req.failed(message, 507 if type(exc).__name__ in _OUT_OF_MEMORY else 424)


def _parse(item: Input) -> LmiRequest:
    return parse_lmi_request(request_body(item))


def _encode(records: list[dict[str, Any]]) -> Output:
    """One binary-encoded record per batch entry, with the per-entry response properties DJL's
    handlers add: none when every entry was refused (djl_python.huggingface answers those
    before its rolling batch), else a content type for each and a request id for each admitted."""
    outputs = Output()
    refused_all = all("content_type" not in record for record in records)
    for i, record in enumerate(records):
        outputs.add(Output.binary_encode(record), key="data", batch_index=i)
        if refused_all:
            continue
        outputs.add_property(f"batch_{i}_Content-Type", record.get("content_type",
                                                                   JSON_MEDIA_TYPE))
        if "content_type" in record:
            outputs.add_property(f"batch_{i}_requestId", record["request_id"])
    return outputs
