"""OpenAI requests -> the engine's `SamplingParams` and `GenerationRequest`.

OpenAI samples by default (temperature 1); temperature 0 is greedy. `top_k` -1 or 0 is off.
Output length: `max_tokens` / `max_completion_tokens`, where null means "up to the context";
`fit_to_context` sets it once the prompt is tokenized, refusing a cap the context cannot hold
(or, with Databricks' `error_behavior: truncate`, lowering it to what the context holds).
"""

from __future__ import annotations

from handlers.engine.types import (
    GenerationRequest,
    RequestValidationError,
    SamplingParams,
    StructuredOutput,
)
from handlers.protocols.openai.errors import OpenAIError
from handlers.protocols.openai.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationFields,
)


def sampling_params(request: GenerationFields, **extra: object) -> SamplingParams:
    """The fields chat and completions share; `extra` sets the endpoint-specific ones."""
    temperature = 1.0 if request.temperature is None else request.temperature
    stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
    return SamplingParams(
        min_new_tokens=request.min_tokens or 0,
        do_sample=temperature > 0,
        temperature=temperature or 1.0,  # greedy rows ignore it; 1.0 keeps engines from dividing
        top_k=max(request.top_k or 0, 0),
        top_p=1.0 if request.top_p is None else request.top_p,
        min_p=request.min_p or 0.0,
        repetition_penalty=request.repetition_penalty or 1.0,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        logit_bias={int(k): v for k, v in (request.logit_bias or {}).items()},
        seed=request.seed,
        stop_sequences=list(dict.fromkeys(stops)),
        stop_token_ids=list(request.stop_token_ids or []),
        ignore_eos=bool(request.ignore_eos),
        include_stop_str_in_output=bool(request.include_stop_str_in_output),
        skip_special_tokens=request.skip_special_tokens is not False,
        n=request.n,
        **extra,  # type: ignore[arg-type]
    )


def chat_sampling_params(request: ChatCompletionRequest,
                         structured: StructuredOutput | None) -> SamplingParams:
    top = (request.top_logprobs or 0) if request.logprobs else 0
    return sampling_params(request, top_logprobs=top, structured=structured)


def completion_sampling_params(request: CompletionRequest) -> SamplingParams:
    return sampling_params(
        request,
        top_logprobs=request.logprobs or 0,
        prompt_logprobs=bool(request.echo) and request.logprobs is not None,
        best_of=request.best_of,
    )


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
