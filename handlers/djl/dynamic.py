"""DJL's dynamic-batch contract (`option.rolling_batch=disable`): a batch in, a batch out.

DJL's front end groups requests by `batch_size` / `max_batch_delay` and sends them in one call
(a single request arrives unbatched). Every prompt of the batch goes to the engine at once and
runs to completion; each item is answered, under its input's content key, with the list of
`{"generated_text": ...}` this project's dynamic-batch schema gives, written as DJL's handler
writes it (`Output.add_as_json`). Items may carry different
parameters. A failed item gets DJL's handler-failure body; one Output has one status for the
whole batch, so only an unbatched request fails with HTTP 424. With `option.enable_streaming`
one request at a time is answered as a jsonlines stream of `{"outputs": [...]}`, as in DJL.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from djl_python.inputs import Input
from djl_python.outputs import Output

from handlers.djl.inputs import request_body, requested_adapter
from handlers.engine.base import Pair, SteppableEngine
from handlers.engine.types import GenerationRequest
from handlers.protocols.errors import ErrorKind, GenerationError, ProtocolError
from handlers.protocols.lmi import lmi_adapters
from handlers.protocols.lmi.dynamic import (
    DynamicError,
    DynamicRequest,
    StreamLines,
    checks,
    parse_dynamic_request,
    render_answer,
    to_generation_requests,
)
from handlers.protocols.outputs import Event, Folded
from handlers.server.driver import stepped, validated
from handlers.server.framing import JSON_MEDIA_TYPE, JSONLINES_MEDIA_TYPE
from handlers.server.status import LMI_HTTP

log = logging.getLogger(__name__)


@dataclass
class _Item:
    """One request of the batch: its prompts' engine requests and their outputs."""

    request: DynamicRequest | None = None
    gens: list[GenerationRequest] = field(default_factory=list)
    accs: list[Folded] = field(default_factory=list)
    error: DynamicError | None = None  # refused before admission

    def answer(self) -> tuple[int, Any]:
        """The status and body of this request's answer."""
        try:
            if self.error is not None:
                raise self.error
            return 200, render_answer(self.accs, self.request)
        except DynamicError as failed:
            status = LMI_HTTP[failed.kind]
            return status, failed.payload(status)


class DynamicBatchDriver:
    def __init__(self, engine: SteppableEngine, streaming: bool) -> None:
        self.engine = engine
        self.streaming = streaming

    def inference(self, inputs: Input) -> Output:
        items = [self._parse(item) for item in inputs.get_batches()]
        if self.streaming:
            if len(items) > 1:
                raise ValueError("option.enable_streaming answers one request at a time: "
                                 "set batch_size=1")
            return self._stream(items[0])
        self._run([item for item in items if item.error is None])
        answers = [item.answer() for item in items]
        if not inputs.is_batch() and answers[0][0] != 200:
            status, body = answers[0]
            return Output().error(body["error"], code=status)
        # As DJL's handler answers (djl_python.encode_decode.encode): each item's JSON under its
        # input's content key, written by Output.add_as_json.
        outputs = Output().add_property("Content-Type", JSON_MEDIA_TYPE)
        for i, (_, body) in enumerate(answers):
            outputs.add_as_json(body, key=inputs.get_content().key_at(i))
        return outputs

    def _parse(self, item: Input) -> _Item:
        try:
            request = parse_dynamic_request(request_body(item))
            named = requested_adapter(item) or request.adapters
            gens = to_generation_requests(request, lmi_adapters(
                named, len(request.inputs), self.engine.model_name, self.engine.adapters,
                DynamicError))
            gens = validated(self.engine, gens, checks(request))
        except ProtocolError as exc:  # a body that is not JSON is refused in LMI's terms
            log.info("[RequestId=%s] invalid request: %s", item.get_property("requestId"),
                     exc.message)
            return _Item(error=DynamicError(exc.message, exc.kind))
        return _Item(request, gens, [Folded() for _ in gens])

    def _run(self, items: list[_Item]) -> None:
        """Run every prompt of the batch to completion, together."""
        owners = [(item, i) for item in items for i in range(len(item.gens))]
        gens = [gen for item in items for gen in item.gens]
        try:
            for pairs in stepped(self.engine, gens):
                for position, output in pairs:
                    item, index = owners[position]
                    item.accs[index].add(output)
        except GenerationError as exc:  # the unfinished requests answer it
            log.warning("dynamic batch stopped short: %s", exc.message)

    def _stream(self, item: _Item) -> Output:
        """Steps until the first text before answering, so that a request failing before any
        text gets an HTTP error instead of a stream."""
        if item.error is not None:
            return Output().error(item.error.message)
        steps = stepped(self.engine, item.gens)
        lines = StreamLines(len(item.gens))
        first = None
        try:
            for pairs in steps:
                first = lines.feed(pairs)
                if first or lines.done:
                    break
        except GenerationError as exc:
            return Output().error(exc.message)
        if lines.failure is not None and not first:
            steps.close()
            return Output().error(lines.failure.message)
        outputs = Output().add_property("content-type", JSONLINES_MEDIA_TYPE)  # as DJL's
        return outputs.add_stream_content(_lines(first, steps, lines), output_formatter=None)


def _lines(first: Event | None, steps: Iterator[list[Pair]], lines: StreamLines
           ) -> Iterator[bytes]:
    """The stream's jsonlines; DJL pulls them after `handle()` returned."""
    try:
        if first:
            yield _frame(first.data)
        if not lines.done:
            for pairs in steps:
                if line := lines.feed(pairs):
                    yield _frame(line.data)
                if lines.done:
                    break
        if lines.failure is not None:
            yield _frame(lines.error(lines.failure.message, LMI_HTTP[lines.failure.kind]).data)
    except Exception as exc:
        log.exception("dynamic-batch stream failed")
        yield _frame(lines.error(str(exc) or type(exc).__name__, LMI_HTTP[ErrorKind.FAILED]).data)
    finally:
        steps.close()  # cancels what still runs when DJL stops reading early


def _frame(line: Any) -> bytes:
    """A line as DJL's default stream formatter writes it (outputs.py: json.dumps, ASCII)."""
    return json.dumps(line).encode() + b"\n"
