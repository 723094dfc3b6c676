"""A loop engine's batcher stepped in the caller's thread (base.SteppableEngine): the DJL entry's
one step per `handle()` call. The engine's loop never runs meanwhile: the two ways never mix on
one engine."""

from __future__ import annotations

import torch

from handlers.engine.loop.engine import LoopEngine
from handlers.engine.types import GenerationRequest, RequestOutput


class DirectStepper:
    def __init__(self, engine: LoopEngine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer

    @property
    def adapters(self) -> tuple[str, ...]:
        return self.engine.adapters

    def validate(self, request: GenerationRequest) -> None:
        self.engine.validate(request)

    def add(self, request: GenerationRequest) -> None:
        self.engine.loop.serving()
        if request.prompt_token_ids is None:  # as generate(): never an untokenized prompt
            self.engine.validate(request)
        self.engine.batcher.add(request)

    def step(self) -> list[RequestOutput]:
        with torch.inference_mode():
            return self.engine.batcher.step()

    def cancel(self, request_id: str) -> None:
        self.engine.batcher.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.engine.batcher.has_work
