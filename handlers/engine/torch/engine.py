"""The torch engine: a loop thread drives `ContinuousBatcher.step()`; asyncio callers submit
requests and read their outputs from per-request queues.

torch releases the GIL inside its kernels, so the event loop keeps serving HTTP while a step
runs. All batcher state is touched only by the loop thread; callers talk to it through a
thread-safe inbox (new requests, aborts). The loop runs in a thread of its own (`start`), or in
the thread that calls `run_forever` (lmi-serve's main thread: torch ops measured ~1.4x faster
there). Instead of either, a caller may step the batcher itself (`add`, `step`, `cancel`: the
DJL entry's one step per call); the two ways never mix on one engine.

Supervision: any exception that escapes the loop (a failed step, a failed abort, a restart
asked for) ends `run_forever` with `failure` set, after every in-flight and queued request got
an `EngineFailure`; `reset()` then gives it a fresh batcher and KV cache (the weights are kept)
for the next `run_forever`. A step running longer than `stall_timeout` makes `stalled()` true.
Health is false while the loop is not running, has failed, or is stalled.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from handlers.engine.hf_tokenizer import HFTokenizer
from handlers.engine.torch import sampling
from handlers.engine.torch.batcher import ContinuousBatcher
from handlers.engine.torch.decode_graphs import DecodeGraphs
from handlers.engine.torch.loader import LoadedModel
from handlers.engine.torch.model_runner import ModelRunner
from handlers.engine.types import (
    EngineFailure,
    GenerationRequest,
    RequestOutput,
    RequestValidationError,
    prompt_ids,
)

log = logging.getLogger(__name__)


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


class TorchEngine:
    """Continuous batching over a Hugging Face causal LM (CPU by default, CUDA when present).

    `new_runner` makes the forward passes' runner (and its KV cache) instead of a `ModelRunner`
    over `loaded.model`: the llama.cpp engine is this loop with its own runner; its `loaded`
    has the fields read here (name, tokenizer, eos_token_ids, dtype, device, max_model_len).
    """

    def __init__(self, loaded: LoadedModel, max_batch_size: int = 32,
                 max_prefill_tokens: int = 512, chat_template: str | None = None,
                 stall_timeout: float | None = None,
                 new_runner: Callable[[], ModelRunner] | None = None,
                 prefix_cache_bytes: int = 0, graphs: DecodeGraphs | None = None) -> None:
        self.model_name = loaded.name
        self.tokenizer = HFTokenizer(loaded.tokenizer, loaded.eos_token_ids, chat_template)
        self.dtype = str(loaded.dtype).removeprefix("torch.")
        self.device = loaded.device.type
        self.max_model_len = loaded.max_model_len
        self.adapters: tuple[str, ...] = ()  # LoRA adapters are the vllm engine's
        self._loaded = loaded
        self._limits = (max_batch_size, max_prefill_tokens, prefix_cache_bytes)
        self._new_runner = new_runner or (
            lambda: ModelRunner(loaded.model, max_batch_size, loaded.max_model_len, graphs))
        self.graphs = graphs
        self.batcher = self._new_batcher()
        self.vocab_size = self.batcher.runner.vocab_size
        self.stall_timeout = stall_timeout  # seconds one step may run; None: no limit
        self.failure: BaseException | None = None  # why the loop last ended, until reset()
        self._step_began: float | None = None  # monotonic time of the step running now
        self._inbox: queue.SimpleQueue[_Submit | _Abort | _Restart | None] = queue.SimpleQueue()
        self._sinks: dict[str, _Submit] = {}
        self._thread: threading.Thread | None = None
        self._running = False
        self._stopping = False

    def _new_batcher(self, counters: dict[str, int] | None = None) -> ContinuousBatcher:
        loaded, (max_batch_size, max_prefill_tokens, prefix_bytes) = self._loaded, self._limits
        return ContinuousBatcher(self._new_runner(), loaded.tokenizer, loaded.eos_token_ids,
                                 max_batch_size, max_prefill_tokens, loaded.max_model_len,
                                 counters, prefix_bytes)

    # -- the Engine interface -------------------------------------------------------------------

    def health(self) -> bool:
        return (self._running and not self._stopping and self.failure is None
                and not self.stalled())

    def validate(self, request: GenerationRequest) -> None:
        params = request.params
        if request.adapter is not None:
            raise RequestValidationError("adapter", f"LoRA adapter {request.adapter!r}: this "
                                         "engine serves none (the vllm engine serves adapters)")
        sampling.validate_params(params, self.vocab_size)
        ids = prompt_ids(request, self.tokenizer.encode, self.max_model_len)
        if params.num_sequences > self.batcher.max_batch_size:
            raise RequestValidationError(
                "best_of" if params.best_of else "n",
                f"{params.num_sequences} sequences exceed max_rolling_batch_size "
                f"{self.batcher.max_batch_size}",
            )
        if params.structured is not None:  # 1-5 ms for a new schema here, then a cache hit
            self.batcher.grammars.compile(params.structured)
        request.prompt_token_ids = ids

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if request.prompt_token_ids is None:
            self.validate(request)
        if not self.health():
            raise EngineFailure("the engine is not running")
        sink: asyncio.Queue = asyncio.Queue()
        self._inbox.put(_Submit(request, sink, asyncio.get_running_loop()))
        finished = False
        try:
            while not finished:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the caller went away (disconnect, cancellation): free the slot
                self._inbox.put(_Abort(request.request_id))

    async def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def stats(self) -> dict[str, int]:
        stats = self.batcher.stats()
        if self.graphs is not None:
            stats.update(self.graphs.counts())
        return stats

    async def start(self) -> None:
        """Run the loop in a thread of its own."""
        self._thread = threading.Thread(target=self.run_forever, name="torch-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the loop to end; safe from any thread and from signal handlers."""
        self._stopping = True
        self._inbox.put(None)
        if self.graphs is not None:
            self.graphs.close()

    async def shutdown(self) -> None:
        self.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # -- supervision (SupervisedLoop) -------------------------------------------------------------

    def _start_graphs(self) -> None:
        """Load or compile the decode graphs once serving begins, not while the server starts:
        loading holds the GIL for seconds."""
        if self.graphs is not None:
            self.graphs.start()

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

    # -- stepping from the caller's thread (SteppableEngine) --------------------------------------

    def add(self, request: GenerationRequest) -> None:
        self._start_graphs()
        if request.prompt_token_ids is None:  # as generate(): never an untokenized prompt
            self.validate(request)
        self.batcher.add(request)

    def step(self) -> list[RequestOutput]:
        with torch.inference_mode():
            return self.batcher.step()

    def cancel(self, request_id: str) -> None:
        self.batcher.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.batcher.has_work

    # -- the engine loop ------------------------------------------------------------------------

    def run_forever(self) -> None:
        """Step while there is work, sleep on the inbox while there is none, until `stop()`
        or a failure (then `failure` says which)."""
        self._running = True
        self._start_graphs()
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
            if isinstance(item, _Submit):
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
            submit.loop.call_soon_threadsafe(submit.sink.put_nowait, output)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, handed to each event loop in one call: one wake-up of a loop (a
        write to its self-pipe) per step, not one per request."""
        handoffs: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for output in outputs:
            submit = self._sink_for(output.request_id, output)
            if submit is not None:
                handoffs.setdefault(submit.loop, []).append((submit.sink, output))
        for loop, handoff in handoffs.items():
            loop.call_soon_threadsafe(_put_all, handoff)

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
                item.loop.call_soon_threadsafe(item.sink.put_nowait, exc)
            stop = stop or item is None
        if stop:
            self._inbox.put(None)


def _put_all(handoff: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for sink, output in handoff:
        sink.put_nowait(output)
