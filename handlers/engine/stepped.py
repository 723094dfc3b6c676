"""An asynchronous engine (vLLM's) stepped synchronously, as the DJL entry steps engines: one
`step()` per `handle()` call returns what every running request produced since the last one.

The engine lives on an event loop in a thread of its own; each added request is one task there
that streams the engine's outputs into a queue the caller's thread drains.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future

from handlers.engine.base import Engine
from handlers.engine.types import (
    FinishReason,
    GenerationRequest,
    RequestMetrics,
    RequestOutput,
    SequenceOutput,
)


class SteppedEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="engine-loop", daemon=True).start()
        self._call(engine.start())
        self._outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._tasks: dict[str, Future] = {}

    @property
    def adapters(self) -> tuple[str, ...]:
        return self.engine.adapters

    def validate(self, request: GenerationRequest) -> None:
        self.engine.validate(request)

    def add(self, request: GenerationRequest) -> None:
        if request.prompt_token_ids is None:
            self.validate(request)
        self._tasks[request.request_id] = asyncio.run_coroutine_threadsafe(
            self._pump(request), self._loop)

    def step(self) -> list[RequestOutput]:
        """What arrived since the last step; while requests run, waits for at least one."""
        outputs: list[RequestOutput] = []
        if self._tasks and self._outputs.empty():
            outputs.append(self._outputs.get())
        while not self._outputs.empty():
            outputs.append(self._outputs.get_nowait())
        for output in outputs:
            if output.finished:
                self._tasks.pop(output.request_id, None)
        return outputs

    def cancel(self, request_id: str) -> None:
        """Stop a request now (its task's cancellation aborts it in the engine)."""
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    @property
    def has_work(self) -> bool:
        return bool(self._tasks) or not self._outputs.empty()

    def shutdown(self) -> None:
        for request_id in list(self._tasks):
            self.cancel(request_id)
        self._call(self.engine.shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _pump(self, request: GenerationRequest) -> None:
        try:
            async for output in self.engine.generate(request):
                self._outputs.put(output)
        except Exception as exc:  # the request fails alone, as a finished output
            error = SequenceOutput(index=0, tokens=[], finish_reason=FinishReason.ERROR,
                                   error=f"{type(exc).__name__}: {exc}")
            self._outputs.put(RequestOutput(
                request_id=request.request_id, outputs=[error],
                prompt_token_count=len(request.prompt_token_ids or ()),
                metrics=RequestMetrics(arrival_time=request.arrival_time), finished=True))

    def _call(self, coroutine) -> None:  # noqa: ANN001 (a coroutine run on the engine's loop)
        asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()
