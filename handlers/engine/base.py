"""The one small interface every engine implements: validate, generate, abort, health."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from handlers.engine.types import GenerationRequest, RequestOutput


class Engine(Protocol):
    model_name: str
    max_model_len: int
    tokenizer: Any  # a Hugging Face tokenizer (encode/decode/apply_chat_template)

    def is_ready(self) -> bool:
        """True once the engine can serve (the model is loaded and the loop runs)."""

    def validate(self, request: GenerationRequest) -> None:
        """Tokenize and check a request before admission; raise RequestValidationError.

        Fills `request.prompt_token_ids` (truncated as `params.truncate` asks).
        """

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's progress; the last output has `finished=True`.

        Closing the iterator early (a client went away) aborts the request.
        """

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its batch slot and cache."""

    def stats(self) -> dict[str, int]:
        """Gauges and counters for /metrics: running_requests, waiting_requests, prompt_tokens,
        generated_tokens, finished_requests."""

    async def start(self) -> None:
        """Start the engine's loop in the background (after the model is loaded)."""

    def run_forever(self) -> None:
        """Run the engine's loop in the calling thread until `stop()` (lmi-serve's main thread)."""

    def stop(self) -> None:
        """Ask the loop to end, from any thread; requests still running end with an abort."""

    async def shutdown(self) -> None:
        """Stop the loop; requests still running finish with an abort."""
