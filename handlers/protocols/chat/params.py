"""Chat requests (and OpenAI's completions, which share their fields) -> the engine's
`SamplingParams`.

OpenAI samples by default (temperature 1); temperature 0 is greedy. `top_k` -1 or 0 is off.
The output length is set at admission (`chat.admit.checks`), once the prompt is tokenized.
"""

from __future__ import annotations

from handlers.engine.types import SamplingParams, StructuredOutput
from handlers.protocols.chat.requests import ChatCompletionRequest, GenerationFields


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

