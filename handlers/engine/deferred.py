"""An Engine that stands in while the real one loads, so the server answers /ping 503 meanwhile."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from handlers.engine.base import Engine
from handlers.engine.types import GenerationRequest, RequestOutput


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
