"""DJL's rolling-batch contract, one engine step per `handle()` call.

DJL's front end sends the whole active batch on every call: the requests already running come
first, in the order they joined, with empty data; new requests follow with their bodies. Each
call runs one engine step and answers one binary-encoded record per batch entry,
in batch order: `data` (the text to append to that request's response), `last`, `content_type`
and, for a failed request, `code` and `error`. DJL drops the requests whose record was `last`
before the next call, and so does this driver. A request that fails validation gets its error
record at once and never enters the batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import orjson
from djl_python.inputs import Input
from djl_python.outputs import Output

from handlers.djl.inputs import request_body
from handlers.engine.base import SteppableEngine
from handlers.engine.types import RequestOutput, RequestValidationError
from handlers.protocols.lmi import (
    LmiError,
    LmiFailure,
    LmiRequest,
    RenderOptions,
    StreamRenderer,
    parse_lmi_request,
    render_json,
    stream_style,
    to_generation_request,
)
from handlers.protocols.outputs import UNFINISHED, Folded
from handlers.server.framing import JSON_MEDIA_TYPE, LMI_FRAMING, Framing
from handlers.server.status import LMI_HTTP

log = logging.getLogger(__name__)


@dataclass
class _Request:
    """One request of DJL's batch, from its arrival to its last record."""

    client_id: str | None  # DJL's requestId, for logs and the requestId property
    request_id: str = ""  # the engine's id
    opts: RenderOptions | None = None
    renderer: StreamRenderer | None = None  # set when the answer is streamed
    framing: Framing | None = None  # the stream's
    acc: Folded = field(default_factory=Folded)
    error: str | None = None  # refused before admission
    sent: bool = False  # whether any data went out already
    done: bool = False


def _record(data: str, last: bool, content_type: str, req: _Request) -> dict[str, Any]:
    record: dict[str, Any] = {"data": data, "last": last, "content_type": content_type}
    if req.client_id is not None:
        record["request_id"] = req.client_id
    return record


def _error_record(req: _Request, message: str, status: int = 424) -> dict[str, Any]:
    req.done = True
    return {**_record("", True, JSON_MEDIA_TYPE, req), "code": status, "error": message}


class RollingBatchDriver:
    def __init__(self, engine: SteppableEngine, output_formatter: str, tgi_compat: bool) -> None:
        self.engine = engine
        self.tgi_compat = tgi_compat
        self.style = stream_style(output_formatter, tgi_compat)
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
        self.running = [req for req in entries if req.error is None]
        try:
            outputs = self.engine.step() if self.engine.has_work else []
        except Exception as exc:  # the batch state is lost: fail everyone, as DJL's batchers do
            log.exception("rolling batch step failed; %d requests fail", len(self.running))
            self.reset()
            message = f"rolling batch inference failed: {exc}"
            return _encode([_error_record(req, req.error or message) for req in entries])
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
            gen = to_generation_request(lmi)
            self.engine.validate(gen)
        except LmiError as exc:
            req.error = exc.message
        except RequestValidationError as exc:
            req.error = f"{exc.field}: {exc.message}"
        if req.error is not None:
            log.info("[RequestId=%s] invalid LMI request: %s", req.client_id, req.error)
            return req
        req.request_id = gen.request_id
        req.opts = RenderOptions.for_request(lmi, self.tgi_compat)
        if lmi.stream and self.style is not None:
            req.renderer = StreamRenderer(req.opts, self.style)
            req.framing = LMI_FRAMING[self.style]
        self.engine.add(gen)
        log.info("[RequestId=%s] LMI request %s joins the batch, stream=%s",
                 req.client_id, gen.request_id, req.renderer is not None)
        return req

    # -- records --------------------------------------------------------------------------------

    def _answer(self, req: _Request, outputs: list[RequestOutput]) -> dict[str, Any]:
        if req.error is not None:
            return _error_record(req, req.error)
        if req.renderer is not None:
            return self._stream_record(req, req.renderer, outputs)
        for out in outputs:
            req.acc.add(out)
        if not req.acc.finished:
            return _record("", False, JSON_MEDIA_TYPE, req)
        req.done = True
        try:
            body = render_json(req.acc, req.opts)
        except LmiFailure as failed:
            return _error_record(req, failed.message, LMI_HTTP[failed.kind])
        return _record(orjson.dumps(body).decode(), True, JSON_MEDIA_TYPE, req)

    def _stream_record(self, req: _Request, renderer: StreamRenderer,
                       outputs: list[RequestOutput]) -> dict[str, Any]:
        events = [event for out in outputs for event in renderer.feed(out)]
        if any(out.finished for out in outputs) and not renderer.done:
            events.append(renderer.error(UNFINISHED))
        if renderer.done and not req.sent:
            failure = renderer.acc.failure()
            if failure is not None:  # nothing went out yet: DJL can still answer an HTTP error
                return _error_record(req, failure.message, LMI_HTTP[failure.kind])
        chunk = b"".join(req.framing.frame(event.data) for event in events)
        req.sent = req.sent or bool(chunk)
        req.done = renderer.done
        return _record(chunk.decode(), renderer.done, req.framing.media_type, req)


def _parse(item: Input) -> LmiRequest:
    return parse_lmi_request(request_body(item))


def _encode(records: list[dict[str, Any]]) -> Output:
    """One binary-encoded record per batch entry, with DJL's per-entry response properties."""
    outputs = Output()
    for i, record in enumerate(records):
        outputs.add(Output.binary_encode(record), key="data", batch_index=i)
        outputs.add_property(f"batch_{i}_Content-Type", record["content_type"])
        if "request_id" in record:
            outputs.add_property(f"batch_{i}_requestId", record["request_id"])
    return outputs

