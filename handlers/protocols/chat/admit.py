"""What a chat-shaped request adds to the engine's checks (`checks`): refusals name the chat
request's fields (in OpenAI's error shape, which Anthropic's and the Responses API's wrappers
convert), and the output length is fitted to the context once the prompt is tokenized.

Output length: `max_tokens` / `max_completion_tokens`, where null means "up to the context". A
cap the context cannot hold is refused, or, with Databricks' `error_behavior: truncate`, lowered
to what the context holds (and an over-long prompt keeps its end).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from handlers.engine.types import GenerationRequest, RequestValidationError
from handlers.protocols.chat.errors import OpenAIError
from handlers.protocols.chat.requests import GenerationFields
from handlers.protocols.checks import Checks, with_max_new_tokens


def checks(request: GenerationFields, prompt_field: Callable[[int], str]) -> Checks:
    """OpenAI's checks for the engine requests of `request`; `prompt_field(i)` names the i-th
    prompt in refusals."""
    def shorten(gen: GenerationRequest, max_model_len: int) -> GenerationRequest:
        """A prompt the context cannot hold keeps its end, leaving the output its room."""
        _, limit = request.max_output_tokens
        truncate = max(1, max_model_len - (limit or 1))
        return replace(gen, params=replace(gen.params, truncate=truncate))

    return Checks(lambda exc, index: engine_refusal(exc, prompt_field(index)),
                  lambda gen, max_model_len: fit_to_context(gen, request, max_model_len),
                  shorten if request.truncates else None)


def fit_to_context(gen: GenerationRequest, request: GenerationFields, max_model_len: int
                   ) -> GenerationRequest:
    """A validated request (its prompt tokenized) with its `max_new_tokens` set."""
    prompt_tokens = len(gen.prompt_token_ids or [])
    room = max_model_len - prompt_tokens
    field, limit = request.max_output_tokens
    if limit is not None and limit > room and request.truncates:
        limit = room  # as many tokens as the context holds
    if limit is not None and limit > room:
        raise OpenAIError(
            f"{field}: {limit} is too large; this model's context is {max_model_len} tokens "
            f"and the prompt takes {prompt_tokens}, leaving {room}",
            field, code="context_length_exceeded")
    return with_max_new_tokens(gen, room if limit is None else limit)


def engine_refusal(exc: RequestValidationError, prompt_field: str) -> OpenAIError:
    """An engine's validation error in OpenAI's shape; the engine's `inputs` is the prompt."""
    if exc.field == "inputs":
        code = "context_length_exceeded" if "context" in exc.message else "invalid_value"
        return OpenAIError(f"{prompt_field}: {exc.message}", prompt_field, code=code)
    return OpenAIError(f"{exc.field}: {exc.message}", exc.field, code="invalid_value")
