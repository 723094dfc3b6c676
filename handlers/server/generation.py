"""A `Generation`: one client request's engine requests in flight, admitted against
`job_queue_size` (`Admission`, counting their sequences), submitted together (as one job to an
engine that runs groups, else merged from one stream per request), read as groups of `(index,
output)` pairs, bounded by the request's deadline, and aborted when closed unfinished (a client
that went away, a failure, a timeout, a server that stops past its drain limit: `cut`). The
engine raising, or ending a request without finishing it, is a `GenerationError`, once, here;
each protocol says it in its own shape. driver.py reads it.

Every close runs shielded: a client's disconnect cancels the task that would otherwise
abandon an engine request half-done, holding its batch slot and cache.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import NoReturn

import anyio

from handlers.engine.base import Engine, GroupEngine, Pair
from handlers.engine.types import EngineFailure, FinishReason, GenerationRequest, RequestOutput
from handlers.protocols.errors import ErrorKind, GenerationError
from handlers.protocols.outputs import UNFINISHED
from handlers.server.telemetry import RequestObserver

log = logging.getLogger(__name__)

class ClientGone(Exception):
    """The client went away before its answer was ready; its requests were aborted."""


class Admission:
    """`job_queue_size`: how many sequences the server holds at once, queued or running (a
    client request holds all of its own, each prompt max(n, best_of)); a request that would
    pass it is refused at once (never queued without bound)."""

    def __init__(self, limit: int, on_reject: Callable[[], None] | None = None) -> None:
        self.limit = limit
        self.held = 0
        self._on_reject = on_reject  # counts the refusal for /metrics

    def acquire(self, sequences: int = 1) -> None:
        if self.held + sequences > self.limit:
            if self._on_reject is not None:
                self._on_reject()
            raise GenerationError(
                f"the server is at its limit of {self.limit} sequences (job_queue_size): "
                f"{self.held} are held and this request asks for {sequences}; retry later",
                ErrorKind.OVERLOADED)
        self.held += sequences

    def release(self, sequences: int = 1) -> None:
        self.held -= sequences


class Generation:
    """One client request's engine requests, from submission to their last output."""

    def __init__(self, engine: Engine, requests: list[GenerationRequest],
                 admission: Admission | None = None, timeout: float | None = None,
                 outcome: Callable[[bool], None] | None = None,
                 observer: RequestObserver | None = None,
                 timeout_source: str = "option.predict_timeout") -> None:
        # One group: an engine that schedules its own batch shares it between client requests.
        requests = [replace(request, group=requests[0].request_id) for request in requests]
        self._sequences = sum(request.params.num_sequences for request in requests)
        if admission is not None:
            admission.acquire(self._sequences)
        self._admission = admission
        self._engine = engine
        self.requests = requests
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._timeout = timeout
        self._timeout_source = timeout_source  # which deadline `timeout` is, for the error
        # Each engine request's end, as the engine's health: False for the engine's failure,
        # True for an answer; a request refused for its own settings is neither.
        self._outcome = outcome or (lambda ok: None)
        self._open = set(range(len(requests)))  # requests not finished yet
        self._observer = observer  # what /metrics learns of each output
        if isinstance(engine, GroupEngine):
            self._source = engine.submit(requests)
        else:
            self._source = _merged(engine, requests)
        self._closed = False
        self._reader: asyncio.Task | None = None  # the task waiting for outputs, while it waits
        self._cut: str | None = None  # why the server ended it (`cut`)
        self._cut_reader = False  # `cut` cancelled the reader's wait

    def cut(self, reason: str) -> None:
        """End it now, as unavailable for `reason`: the wait for outputs under way (or the next
        one) raises GenerationError. Call on the server's event loop."""
        if self._cut is None:
            self._cut = reason
            if self._reader is not None:  # it waits in `_wait`, where the cancel lands
                self._cut_reader = self._reader.cancel()  # no cancel scope costs each output

    @property
    def closed(self) -> bool:
        return self._closed

    async def next(self) -> list[Pair] | None:
        """The outputs that arrived together; None once every request finished."""
        if not self._open:
            await self.aclose()
            return None
        try:
            if self._cut is not None:
                raise GenerationError(self._cut, ErrorKind.UNAVAILABLE)
            pairs = await self._wait()
        except TimeoutError:
            await self._fail(GenerationError(
                f"the request ran past its deadline of {self._timeout:g} s "
                f"({self._timeout_source})", ErrorKind.TIMEOUT))
        except asyncio.CancelledError:
            if not self._took_cut():
                raise
            await self._fail(GenerationError(self._cut, ErrorKind.UNAVAILABLE))
        except GenerationError as exc:
            await self._fail(exc)
        except Exception as exc:
            if not isinstance(exc, EngineFailure):  # the engine's supervisor handles those
                self._outcome(False)
            await self._fail(GenerationError(str(exc) or type(exc).__name__, crashed=True), exc)
        if pairs is None:
            await self._fail(GenerationError(UNFINISHED))
        if self._observer is not None:
            self._observer.outputs(pairs)
        for index, output in pairs:
            if output.finished:
                self._open.discard(index)
                self._record(output)
        return pairs

    async def _fail(self, error: GenerationError, cause: BaseException | None = None
                    ) -> NoReturn:
        """Close with `error` as the reason, and raise it."""
        await self.aclose(error.message)
        raise error from cause

    def _record(self, output: RequestOutput) -> None:
        reasons = {seq.finish_reason for seq in output.outputs}
        if FinishReason.ERROR in reasons:
            self._outcome(False)
        elif FinishReason.REFUSED not in reasons:
            self._outcome(True)

    async def __aiter__(self) -> AsyncIterator[list[Pair]]:
        try:
            while (pairs := await self.next()) is not None:
                yield pairs
        finally:
            await self.aclose()

    async def aclose(self, error: str | None = None) -> None:
        """Abort what is still running and give the admission back (idempotent). Each
        unfinished request is aborted by its id as well: an engine's own clean-up may not get
        to run inside a cancelled task. `error`: why it ended early, for its trace."""
        if self._closed:
            return
        self._closed = True
        if self._observer is not None:
            self._observer.abandoned(self._open)
            if error is None and self._open:
                error = "abandoned unfinished (the client went away, or the answer failed)"
            self._observer.closed(error)
        with anyio.CancelScope(shield=True):
            await self._source.aclose()
            for index in sorted(self._open):
                await self._engine.abort(self.requests[index].request_id)
        if self._admission is not None:
            self._admission.release(self._sequences)

    async def _wait(self) -> list[Pair] | None:
        """The engine's next outputs, within the deadline; `cut` may cancel the wait."""
        self._reader = asyncio.current_task()
        try:
            with self._deadline_scope():
                return await anext(self._source, None)
        finally:
            self._reader = None

    def _took_cut(self) -> bool:
        """Whether the cancellation that reached the reader is only `cut`'s (then withdrawn):
        another (a client gone, the server's own end) goes on."""
        if not self._cut_reader:
            return False
        uncancel = getattr(asyncio.current_task(), "uncancel", None)  # Python >= 3.11
        return uncancel is None or uncancel() == 0

    def _deadline_scope(self) -> AbstractContextManager:
        """A cancel scope up to the deadline; none at all without one (a scope per output was
        ~10% of the HTTP thread's work at one stream)."""
        if self._deadline is None:
            return nullcontext()
        return anyio.fail_after(max(self._deadline - time.monotonic(), 0))


async def _merged(engine: Engine, requests: list[GenerationRequest]
                  ) -> AsyncIterator[list[Pair]]:
    """The requests' output streams interleaved as their outputs arrive, at most the engine's
    `group_window` of them in it at once (the next starting as one finishes); closing it closes
    every stream (the engine aborts the unfinished requests)."""
    if len(requests) == 1:
        stream = engine.generate(requests[0])
        try:
            async for output in stream:
                yield [(0, output)]
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
    done = object()

    async def pump(index: int) -> None:
        try:
            async for output in engine.generate(requests[index]):
                queue.put_nowait((index, output))
            queue.put_nowait((index, done))
        except Exception as exc:
            queue.put_nowait((index, exc))

    window = engine.group_window or len(requests)
    pumps = [asyncio.create_task(pump(i)) for i in range(min(window, len(requests)))]
    try:
        running = len(requests)
        while running:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            pairs = []
            for index, item in items:
                if isinstance(item, BaseException):
                    raise item
                if item is done:
                    running -= 1
                    if len(pumps) < len(requests):
                        pumps.append(asyncio.create_task(pump(len(pumps))))
                else:
                    pairs.append((index, item))
            if pairs:
                yield pairs
    finally:
        for task in pumps:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*pumps, return_exceptions=True)
