"""The engine thread: it steps a continuous batcher while there is work and sleeps on its inbox
while there is none. All batcher state is touched only by this thread; asyncio callers talk to
it through the thread-safe inbox (new requests, aborts) and read each request's outputs from a
queue of their own. It runs in a thread of its own (`start`), or in the thread that calls
`run_forever` (lmi-serve's main thread: torch ops measured ~1.4x faster there).

Supervision (base.SupervisedLoop): any exception that escapes the loop (a failed step, a failed
abort, a restart asked for) ends `run_forever` with `failure` set, after every in-flight and
queued request got an `EngineFailure`; `reset()` then gives it a fresh batcher and KV cache (the
weights are kept) for the next `run_forever`. A step running longer than `stall_timeout` makes
`stalled()` true.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from handlers.engine.loop.batcher import ContinuousBatcher
from handlers.engine.types import EngineFailure, GenerationRequest, RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Submit:
    request: GenerationRequest
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Restart:
    reason: str


@dataclass
class _Call:
    work: Callable[[ContinuousBatcher], None]


_Item = _Submit | _Abort | _Restart | _Call | None  # None: stop


class EngineLoop:
    """`new_batcher(counters)` makes a batcher (with a fresh runner and KV cache) that carries
    on `counters` (None: new ones). `on_serve` runs when serving begins (each `run_forever`, and
    each request of a caller stepping the batcher itself): an engine's work that must not hold
    the GIL while the server starts. `on_stop` runs on `stop()`."""

    def __init__(self, new_batcher: Callable[[dict[str, int] | None], ContinuousBatcher],
                 stall_timeout: float | None = None, on_serve: Callable[[], None] | None = None,
                 on_stop: Callable[[], None] | None = None) -> None:
        self._new_batcher = new_batcher
        self.batcher = new_batcher(None)
        self.stall_timeout = stall_timeout  # seconds one step may run; None: no limit
        self._on_serve = on_serve
        self._on_stop = on_stop
        self.failure: BaseException | None = None  # why the loop last ended, until reset()
        self._step_began: float | None = None  # monotonic time of the step running now
        self._inbox: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._sinks: dict[str, _Submit] = {}
        self._thread: threading.Thread | None = None
        self._running = False
        self._stopping = False

    def healthy(self) -> bool:
        """False while the loop is not running, has failed, or is stalled."""
        return (self._running and not self._stopping and self.failure is None
                and not self.stalled())

    def submit(self, request: GenerationRequest, sink: asyncio.Queue) -> None:
        """Queue a validated request; its outputs (a failure: the exception) go to `sink`, on
        the calling event loop."""
        self._inbox.put(_Submit(request, sink, asyncio.get_running_loop()))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def call(self, work: Callable[[ContinuousBatcher], None]) -> None:
        """Run `work` on the batcher in the engine's thread, between steps, in order with the
        submissions before and after it."""
        self._inbox.put(_Call(work))

    def start(self) -> None:
        """Run the loop in a thread of its own."""
        self._thread = threading.Thread(target=self.run_forever, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the loop to end; safe from any thread and from signal handlers."""
        self._stopping = True
        self._inbox.put(None)
        if self._on_stop is not None:
            self._on_stop()

    def join(self) -> None:
        """Wait for the thread `start()` began to end."""
        if self._thread is not None:
            self._thread.join()

    def serving(self) -> None:
        """Serving begins: `on_serve` (idempotent: it runs again on every start and step)."""
        if self._on_serve is not None:
            self._on_serve()

    # -- supervision ----------------------------------------------------------------------------

    def stalled(self) -> bool:
        """Whether the step running now has run past `stall_timeout`."""
        began = self._step_began
        return (self.stall_timeout is not None and began is not None
                and time.monotonic() - began > self.stall_timeout)

    def restart(self, reason: str) -> None:
        """Make the loop fail with `reason` (its requests get the error), so that its
        supervisor resets it or stops the process; safe from any thread."""
        self._inbox.put(_Restart(reason))

    def abandon(self, reason: str) -> None:
        """Fail every request now, from another thread, while the loop is stuck in a step."""
        self.failure = EngineFailure(reason)
        self._fail_all(self.failure, abort=False)

    def reset(self) -> None:
        """A fresh batcher and KV cache after a failure; counters carry on."""
        self.batcher = self._new_batcher(self.batcher.counters)
        self._sinks.clear()
        self._step_began = None
        self.failure = None

    # -- the loop -------------------------------------------------------------------------------

    def run_forever(self) -> None:
        """Step while there is work, sleep on the inbox while there is none, until `stop()`
        or a failure (then `failure` says which)."""
        self._running = True
        self.serving()
        try:
            self._run()
        except Exception as exc:  # the batcher's state is no longer trusted: fail everything
            log.exception("the engine loop failed")
            self.failure = exc
            failure = exc if isinstance(exc, EngineFailure) else EngineFailure(
                f"the engine failed ({type(exc).__name__}: {exc})")
            self._fail_all(failure, abort=False)
            self._fail_queued(failure)
        finally:
            self._running = False
            self._step_began = None

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                if not self._drain_inbox(block=not self.batcher.has_work):
                    break
                if not self.batcher.has_work:
                    continue
                self._step_began = time.monotonic()
                outputs = self.batcher.step(emit_first=self._deliver)
                self._step_began = None
                self._deliver_step(outputs)
        self._fail_all(RuntimeError("the engine shut down"))

    def _drain_inbox(self, block: bool) -> bool:
        """Apply pending submissions and aborts; False once shutdown was asked for."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if item is None:
                return False
            if isinstance(item, _Restart):
                raise EngineFailure(item.reason)
            if isinstance(item, _Call):
                item.work(self.batcher)
            elif isinstance(item, _Submit):
                self._sinks[item.request.request_id] = item
                self.batcher.add(item.request)
            else:
                output = self.batcher.abort(item.request_id)
                self._sinks.pop(item.request_id, None)
                if output is not None:
                    log.info("aborted request %s", item.request_id)

    def _deliver(self, output: RequestOutput | BaseException, request_id: str = "") -> None:
        rid = output.request_id if isinstance(output, RequestOutput) else request_id
        submit = self._sink_for(rid, output)
        if submit is not None:
            _hand_to(submit.loop, submit.sink.put_nowait, output)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, handed to each event loop in one call: one wake-up of a loop (a
        write to its self-pipe) per step, not one per request."""
        handoffs: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for output in outputs:
            submit = self._sink_for(output.request_id, output)
            if submit is not None:
                handoffs.setdefault(submit.loop, []).append((submit.sink, output))
        for loop, handoff in handoffs.items():
            _hand_to(loop, _put_all, handoff)

    def _sink_for(self, request_id: str, output: RequestOutput | BaseException) -> _Submit | None:
        """Where the request's `output` goes (None: it was aborted); its last one (finished, or
        a failure) also forgets the request."""
        submit = self._sinks.get(request_id)
        if submit is not None and (not isinstance(output, RequestOutput) or output.finished):
            del self._sinks[request_id]
        return submit

    def _fail_all(self, exc: Exception, abort: bool = True) -> None:
        """End every request with `exc`; `abort`: free their slots too (a batcher that failed
        is replaced instead)."""
        for request_id in list(self._sinks):
            if abort:
                self.batcher.abort(request_id)
            self._deliver(exc, request_id)

    def _fail_queued(self, exc: Exception) -> None:
        """End the submissions still in the inbox (a stop asked for is kept)."""
        stop = False
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Submit):
                _hand_to(item.loop, item.sink.put_nowait, exc)
            stop = stop or item is None
        if stop:
            self._inbox.put(None)


def _hand_to(loop: asyncio.AbstractEventLoop, callback: Callable[[T], None], arg: T) -> None:
    """Run `callback(arg)` on a requester's event loop; a loop that closed has nobody waiting
    (a server that stopped while the step ran): what was for it is dropped, the loop runs on."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, arg)


def _put_all(handoff: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for sink, output in handoff:
        sink.put_nowait(output)
