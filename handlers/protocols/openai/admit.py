"""Admission of an OpenAI request's engine requests: the engine tokenizes and checks each one,
then its output length is fitted to the context.

Output length: `max_tokens` / `max_completion_tokens`, where null means "up to the context". A
cap the context cannot hold is refused, or, with Databricks' `error_behavior: truncate`, lowered
to what the context holds (and an over-long prompt keeps its end).
"""

from __future__ import annotations

from handlers.engine.base import Engine
from handlers.engine.types import GenerationRequest, RequestValidationError
from handlers.protocols.chat.errors import OpenAIError
from handlers.protocols.chat.requests import GenerationFields


def admit(engine: Engine, gen: GenerationRequest, request: GenerationFields,
          prompt_field: str) -> None:
    """Tokenize and check with the engine, then fit the output length to the context; raise
    OpenAIError naming `prompt_field` (or the offending parameter)."""
    try:
        _validate(engine, gen, request)
    except RequestValidationError as exc:
        raise engine_refusal(exc, prompt_field) from None
    fit_to_context(gen, request, engine.max_model_len)


def _validate(engine: Engine, gen: GenerationRequest, request: GenerationFields) -> None:
    try:
        engine.validate(gen)
    except RequestValidationError as exc:
        if exc.field != "inputs" or not request.truncates:
            raise
        # A prompt the context cannot hold: keep its end, leaving the output its room.
        _, limit = request.max_output_tokens
        gen.params.truncate = max(1, engine.max_model_len - (limit or 1))
        engine.validate(gen)


def fit_to_context(gen: GenerationRequest, request: GenerationFields, max_model_len: int) -> None:
    """Set `max_new_tokens` for a validated request (its prompt tokenized)."""
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
    gen.params.max_new_tokens = room if limit is None else limit


def engine_refusal(exc: RequestValidationError, prompt_field: str) -> OpenAIError:
    """An engine's validation error in OpenAI's shape; the engine's `inputs` is the prompt."""
    if exc.field == "inputs":
        code = "context_length_exceeded" if "context" in exc.message else "invalid_value"
        return OpenAIError(f"{prompt_field}: {exc.message}", prompt_field, code=code)
    return OpenAIError(f"{exc.field}: {exc.message}", exc.field, code="invalid_value")
