"""DJL's dynamic-batch contract (`option.rolling_batch=disable`): a batch in, a batch out.

DJL's front end groups requests by `batch_size` / `max_batch_delay` and sends them in one call
(a single request arrives unbatched). Every prompt of the batch goes to the engine at once and
runs to completion; each item is answered, under its own batch key, with the list of
`{"generated_text": ...}` this project's dynamic-batch schema gives. Items may carry different
parameters. A failed item gets DJL's handler-failure body; one Output has one status for the
whole batch, so only an unbatched request fails with HTTP 424. With `option.enable_streaming`
one request at a time is answered as a jsonlines stream of `{"outputs": [...]}`, as in DJL.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from djl_python.inputs import Input
from djl_python.outputs import Output

from handlers.djl.inputs import request_body
from handlers.djl.stepping import Pair, run_steps
from handlers.engine.torch.engine import TorchEngine
from handlers.engine.types import GenerationRequest, RequestValidationError
from handlers.protocols.lmi.accumulator import Accumulator
from handlers.protocols.lmi.dynamic import (
    HANDLER_FAILURE,
    DynamicRequest,
    StreamLines,
    error_body,
    input_field,
    parse_dynamic_request,
    render_answer,
    to_generation_requests,
)
from handlers.protocols.lmi.errors import LmiError
from handlers.protocols.lmi.formatters import JSON_MEDIA_TYPE, JSONLINES_MEDIA_TYPE

log = logging.getLogger(__name__)

UNFINISHED = "the engine ended the request without finishing it"


@dataclass
class _Item:
    """One request of the batch: its prompts' engine requests and their outputs."""

    request: DynamicRequest | None = None
    gens: list[GenerationRequest] = field(default_factory=list)
    accs: list[Accumulator] = field(default_factory=list)
    error: str | None = None  # refused before admission

    def answer(self) -> tuple[int, bytes]:
        if self.error is not None:
            return 424, error_body(self.error)
        return render_answer(self.accs, self.request)


class DynamicBatchDriver:
    def __init__(self, engine: TorchEngine, streaming: bool) -> None:
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
        if not inputs.is_batch():
            status, body = items[0].answer()
            return _json(Output(status, "OK" if status == 200 else HANDLER_FAILURE), body)
        outputs = Output()
        for i, item in enumerate(items):
            outputs.add(item.answer()[1], key="data", batch_index=i)
        return outputs.add_property("Content-Type", JSON_MEDIA_TYPE)

    def _parse(self, item: Input) -> _Item:
        try:
            request = parse_dynamic_request(request_body(item))
            gens = to_generation_requests(request)
            for index, gen in enumerate(gens):
                self._validate(request, index, gen)
        except LmiError as exc:
            log.info("[RequestId=%s] invalid request: %s", item.get_property("requestId"),
                     exc.message)
            return _Item(error=exc.message)
        return _Item(request, gens, [Accumulator() for _ in gens])

    def _validate(self, request: DynamicRequest, index: int, gen: GenerationRequest) -> None:
        try:
            self.engine.validate(gen)
        except RequestValidationError as exc:
            where = input_field(request, index) if exc.field == "inputs" else exc.field
            raise LmiError(f"{where}: {exc.message}") from None

    def _run(self, items: list[_Item]) -> None:
        """Run every prompt of the batch to completion, together."""
        owners = [(item, i) for item in items for i in range(len(item.gens))]
        gens = [gen for item in items for gen in item.gens]
        for pairs in run_steps(self.engine.batcher, gens):
            for position, output in pairs:
                item, index = owners[position]
                item.accs[index].add(output)

    def _stream(self, item: _Item) -> Output:
        """Steps until the first text before answering, so that a request failing before any
        text gets an HTTP error instead of a stream."""
        if item.error is not None:
            return Output().error(item.error)
        steps = run_steps(self.engine.batcher, item.gens)
        lines = StreamLines(len(item.gens))
        first = b""
        for pairs in steps:
            first = lines.feed(pairs)
            if first or lines.done:
                break
        if lines.failure is not None and not first:
            steps.close()
            return Output().error(lines.failure)
        outputs = Output().add_property("Content-Type", JSONLINES_MEDIA_TYPE)
        return outputs.add_stream_content(_lines(first, steps, lines), output_formatter=None)


def _lines(first: bytes, steps: Iterator[list[Pair]], lines: StreamLines) -> Iterator[bytes]:
    """The stream's jsonlines; DJL pulls them after `handle()` returned."""
    try:
        if first:
            yield first
        if not lines.done:
            for pairs in steps:
                if line := lines.feed(pairs):
                    yield line
                if lines.done:
                    break
        if lines.failure is not None:
            yield lines.error(lines.failure)
        elif not lines.done:
            yield lines.error(UNFINISHED)
    except Exception as exc:
        log.exception("dynamic-batch stream failed")
        yield lines.error(str(exc) or type(exc).__name__)
    finally:
        steps.close()  # aborts what still runs when DJL stops reading early


def _json(outputs: Output, body: bytes) -> Output:
    return outputs.add_property("Content-Type", JSON_MEDIA_TYPE).add(body)
