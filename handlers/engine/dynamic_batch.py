"""LMI's dynamic batching (`option.rolling_batch=disable`) over any Engine.

Each client request is a job of one or more prompts (an LMI `inputs` list). Jobs are grouped into
batches: a batch closes once `batch_size` jobs are queued or `max_batch_delay` ms passed since
its first job arrived; every prompt of the batch then goes to the inner engine at once, and the
next batch starts only when this one has finished, as DJL Serving's batch aggregator does.
Prompts of one batch may carry different parameters (the inner engine samples per row), and a
failure ends only its own job. All state lives on the callers' event loop: no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from handlers.engine.base import AnswerParsing, Engine, Pair, Tokenizer
from handlers.engine.types import AdapterActivity, GenerationRequest, RequestOutput

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Job:
    requests: list[GenerationRequest]
    arrival: float  # event-loop time
    outputs: asyncio.Queue[tuple[int, RequestOutput | Exception]] = field(
        default_factory=asyncio.Queue
    )
    pumps: list[asyncio.Task] = field(default_factory=list)
    closed: bool = False


class JobStream:
    """One job's outputs. Each item lists the (prompt index, output) pairs that arrived together
    (usually one engine step). Ends once every prompt finished; raises the first failure;
    `aclose()` before the end aborts what is left of the job."""

    def __init__(self, batcher: DynamicBatcher, job: _Job) -> None:
        self._batcher = batcher
        self._job = job
        self._open = set(range(len(job.requests)))  # prompts not finished yet
        self._failure: Exception | None = None  # raised once the outputs before it were read

    def __aiter__(self) -> JobStream:
        return self

    async def __anext__(self) -> list[Pair]:
        if self._failure is not None:
            await self.aclose()
            raise self._failure
        if not self._open:
            raise StopAsyncIteration
        items = [await self._job.outputs.get()]
        while not self._job.outputs.empty():
            items.append(self._job.outputs.get_nowait())
        pairs: list[Pair] = []
        for index, item in items:
            if isinstance(item, Exception):
                self._failure = item
                break
            if item.finished:
                self._open.discard(index)
            pairs.append((index, item))
        if not pairs:  # a failure came first: raise it now
            return await self.__anext__()
        return pairs

    async def aclose(self) -> None:
        if self._open:
            self._open.clear()
            self._batcher.close(self._job)


class DynamicBatcher:
    """The Engine interface, with requests run in dynamic batches by the inner engine.

    `submit()` queues one client request's prompts as one job (GroupEngine); `generate()` is a
    job of one.
    """

    def __init__(self, inner: Engine, batch_size: int, max_batch_delay_ms: int) -> None:
        self.inner = inner
        self.model_name = inner.model_name
        self.batch_size = batch_size
        self.max_batch_delay = max_batch_delay_ms / 1000
        self._queue: deque[_Job] = deque()
        self._arrived = asyncio.Event()
        self._runner: asyncio.Task | None = None
        self._jobs: dict[str, _Job] = {}  # request id -> its job, until the job ends
        self._batches = 0
        self._batched_requests = 0

    @property
    def tokenizer(self) -> Tokenizer:
        return self.inner.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    @property
    def dtype(self) -> str:
        return self.inner.dtype

    @property
    def device(self) -> str:
        return self.inner.device

    @property
    def quantization(self) -> str:
        return self.inner.quantization

    @property
    def kv_cache_dtype(self) -> str | None:
        return getattr(self.inner, "kv_cache_dtype", None)

    @property
    def adapters(self) -> tuple[str, ...]:
        return self.inner.adapters

    @property
    def answer_parsing(self) -> AnswerParsing | None:
        return self.inner.answer_parsing

    # A job's prompts all go to the inner engine with its batch, as DJL's batch aggregator
    # sends them; the inner engine shares them out by their group.
    group_window = None

    def adapter_activity(self) -> AdapterActivity | None:
        return self.inner.adapter_activity()

    async def add_adapter(self, name: str, path: Path) -> None:
        await self.inner.add_adapter(name, path)

    async def pin_adapter(self, name: str, pinned: bool) -> None:
        await self.inner.pin_adapter(name, pinned)

    async def remove_adapter(self, name: str) -> None:
        await self.inner.remove_adapter(name)

    async def release_session(self, session: str) -> None:
        await self.inner.release_session(session)

    # -- the Engine interface -------------------------------------------------------------------

    def health(self) -> bool:
        return self.inner.health()

    def validate(self, request: GenerationRequest) -> None:
        self.inner.validate(request)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        stream = self.submit([request])
        try:
            async for pairs in stream:
                for _, output in pairs:
                    yield output
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        job = self._jobs.get(request_id)
        if job is not None:
            self.close(job)
        await self.inner.abort(request_id)

    def stats(self) -> dict[str, int]:
        stats = dict(self.inner.stats())
        queued = sum(len(job.requests) for job in self._queue if not job.closed)
        stats["waiting_requests"] = stats.get("waiting_requests", 0) + queued
        stats["dynamic_batches"] = self._batches
        stats["dynamic_batch_requests"] = self._batched_requests
        return stats

    async def start(self) -> None:
        await self.inner.start()

    async def shutdown(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
        for job in list(self._queue):
            self.close(job)
        await self.inner.shutdown()

    # -- jobs -----------------------------------------------------------------------------------

    def submit(self, requests: list[GenerationRequest]) -> JobStream:
        """Queue one client request's (validated) prompts as one job; call on the event loop."""
        loop = asyncio.get_running_loop()
        job = _Job(list(requests), loop.time())
        self._queue.append(job)
        self._jobs.update((r.request_id, job) for r in requests)
        self._arrived.set()
        if self._runner is None or self._runner.done():
            self._runner = loop.create_task(self._run_batches())
        return JobStream(self, job)

    def close(self, job: _Job) -> None:
        """End a job early: a queued job is skipped when its batch forms; running prompts are
        aborted."""
        if job.closed:
            return
        job.closed = True
        for pump in job.pumps:
            pump.cancel()  # the inner stream closes, and the inner engine aborts the request
        self._forget(job)
        job.outputs.put_nowait((-1, RuntimeError("the request was aborted")))  # wakes a reader

    def _forget(self, job: _Job) -> None:
        for request in job.requests:
            self._jobs.pop(request.request_id, None)

    # -- the batch loop (runs while there are jobs, then ends) ----------------------------------

    async def _run_batches(self) -> None:
        while batch := await self._next_batch():
            await self._run(batch)

    async def _next_batch(self) -> list[_Job]:
        """Wait until `batch_size` jobs are queued or the first one's delay is over; take them."""
        loop = asyncio.get_running_loop()
        while True:
            while self._queue and self._queue[0].closed:
                self._queue.popleft()
            if not self._queue:
                return []
            live = sum(not job.closed for job in self._queue)
            remaining = self._queue[0].arrival + self.max_batch_delay - loop.time()
            if live >= self.batch_size or remaining <= 0:
                break
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), remaining)
        batch: list[_Job] = []
        while self._queue and len(batch) < self.batch_size:
            job = self._queue.popleft()
            if not job.closed:
                batch.append(job)
        return batch

    async def _run(self, batch: list[_Job]) -> None:
        self._batches += 1
        self._batched_requests += len(batch)
        sequences = sum(r.params.num_sequences for job in batch for r in job.requests)
        log.info("dynamic batch %d: %d requests, %d sequences",
                 self._batches, len(batch), sequences)
        for job in batch:
            job.pumps = [asyncio.create_task(self._pump(job, i)) for i in range(len(job.requests))]
        await asyncio.gather(*(p for job in batch for p in job.pumps), return_exceptions=True)
        for job in batch:
            self._forget(job)

    async def _pump(self, job: _Job, index: int) -> None:
        """Forward one prompt's inner stream to its job; failures go to the job's reader."""
        finished = False
        try:
            async for output in self.inner.generate(job.requests[index]):
                finished = output.finished
                job.outputs.put_nowait((index, output))
        except Exception as exc:
            job.outputs.put_nowait((index, exc))
            return
        if not finished:
            error = RuntimeError("the engine ended the request without finishing it")
            job.outputs.put_nowait((index, error))
