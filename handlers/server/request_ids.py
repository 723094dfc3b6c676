"""Each client request's id, for the wires and the logs: bound in a context variable while the
request is served, so every log line written on its behalf, the generation driver's included,
carries `[RequestId=...]` (and `request_id` and `log_ids` attributes), whichever logger writes
it; with traces on, `TraceId=...` too, once the request's trace has begun.

The id is the caller's (SageMaker's `X-Amzn-SageMaker-Inference-Id`, an `X-Request-Id`, or the
protocol's own, such as KServe's `id`) when it gave one, else a fresh one.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

MAX_LENGTH = 128
_UNPRINTABLE = re.compile(r"[^\x21-\x7e]")  # a caller's id must not forge or split log lines


@dataclass
class RequestId:
    value: str
    given: bool  # the caller chose it: a body's own id does not replace it
    # The caller's W3C trace context (traceparent, tracestate), kept only while tracing is on.
    trace_headers: dict[str, str] = field(default_factory=dict)
    trace_id: str | None = None  # set once the request's trace began: its log lines show it
    session: str | None = None  # the stateful session it names (X-Amzn-SageMaker-Session-Id)
    # The model it is for, when its caller targets one: SageMaker's
    # X-Amzn-SageMaker-Target-Model, or /models/{name}/invoke's name.
    target: str | None = None

    def adopt(self, protocol_id: str | None) -> None:
        """Take the protocol's id from the body, unless the caller's header named one."""
        clean = sanitize(protocol_id)
        if clean and not self.given:
            self.value, self.given = clean, True


_current: ContextVar[RequestId | None] = ContextVar("lmi_request_id", default=None)


def sanitize(given: str | None) -> str | None:
    """A caller's id, printable and bounded, or None when nothing of it is usable."""
    clean = _UNPRINTABLE.sub("", given or "")[:MAX_LENGTH]
    return clean or None


def new_id(*given: str | None) -> RequestId:
    """The first usable id of those given, else a fresh one."""
    chosen = next((clean for clean in map(sanitize, given) if clean), None)
    return RequestId(chosen or uuid.uuid4().hex, chosen is not None)


def current() -> RequestId | None:
    return _current.get()


def target_model(name: str) -> None:
    """The request being served is for model `name` (its route's path says so)."""
    bound = _current.get()
    if bound is not None:
        bound.target = name


@contextmanager
def bound(request_id: RequestId) -> Iterator[RequestId]:
    """Serve a request under `request_id`: log lines written meanwhile carry it."""
    token = _current.set(request_id)
    try:
        yield request_id
    finally:
        _current.reset(token)


def install_log_ids() -> None:
    """Make every log record carry the bound request id (idempotent): a record factory rather
    than a handler filter, so uvicorn's and pytest's handlers show it as well as ours."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "adds_request_ids", False):
        return

    def factory(*args: object, **kwargs: object) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        bound_id = _current.get()
        record.request_id = bound_id.value if bound_id is not None else "-"
        record.log_ids = f"RequestId={record.request_id}"  # what a line's brackets hold
        if bound_id is not None and bound_id.trace_id is not None:
            record.log_ids += f" TraceId={bound_id.trace_id}"
        if bound_id is not None and isinstance(record.msg, str):
            prefix = f"[{record.log_ids}] "
            # %-formatting applies to the message only when it has arguments
            record.msg = (prefix.replace("%", "%%") if record.args else prefix) + record.msg
        return record

    factory.adds_request_ids = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
