"""Engines that stand in for a real one: `DeferredEngine` while it loads (so /ping answers 503
meanwhile), `NoGeneration` where none is served (an embeddings-only server)."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

from handlers.engine.base import Engine
from handlers.engine.types import GenerationRequest, RequestOutput, RequestValidationError


class EngineNotReady(RuntimeError):
    pass


class DeferredEngine:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._engine: Engine | None = None

    def attach(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise EngineNotReady("the model is still loading")
        return self._engine

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def is_ready(self) -> bool:
        return self._engine is not None and self._engine.is_ready()

    def validate(self, request: GenerationRequest) -> None:
        self.engine.validate(request)

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(request)

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            await self._engine.abort(request_id)

    def stats(self) -> dict[str, int]:
        return self.engine.stats()

    async def start(self) -> None:
        await self.engine.start()

    async def shutdown(self) -> None:
        if self._engine is not None:
            await self._engine.shutdown()


class NoGeneration:
    """The engine of a server that serves an embedding model only: ready, and every generation
    request is refused before admission (so each protocol answers in its own error shape)."""

    tokenizer: Any = None
    max_model_len = 0

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._stopped = threading.Event()

    @property
    def refusal(self) -> RequestValidationError:
        return RequestValidationError(
            "inputs", f"'{self.model_name}' is an embedding model: this server generates no text "
            "(option.task=text-embedding); send {\"input\": ...} or use /v1/embeddings")

    def is_ready(self) -> bool:
        return True

    def validate(self, request: GenerationRequest) -> None:
        raise self.refusal

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        raise self.refusal  # routes call validate() first; this guards a direct call

    async def abort(self, request_id: str) -> None:
        return None

    def stats(self) -> dict[str, int]:
        return {}

    async def start(self) -> None:
        return None

    def run_forever(self) -> None:
        self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()

    async def shutdown(self) -> None:
        self.stop()
