"""What every engine can run: the ranges of a request's settings that a sampler over float32
logits applies without overflow, token ids its vocabulary holds, and output lengths its context
holds. The driver checks them for every request of every route before admission, whatever its
protocol already checked (each protocol's own limits match its reference; these are what keeps
one request from failing the batch step it shares with others).

Chosen bounds, and why:
- temperature in [0, 1e6]: above it every distribution is uniform to float32's precision;
- repetition_penalty in [1e-6, 1e6]: past them a seen token's logit is already 0 or certain,
  and float32 still holds every logit it makes;
- presence_penalty and frequency_penalty in [-2, 2] (OpenAI's and vLLM's range), logit_bias
  values in [-100, 100] (OpenAI's): larger ones overflow a logit times a token's count;
- top_p, typical_p in (0, 1]; min_p in [0, 1];
- seed a 64-bit integer, signed or not (what the generators take);
- token ids (logit_bias keys, stop_token_ids, a prompt given as ids) below the vocabulary's
  size, and at least 0;
- max_new_tokens and min_new_tokens at most the context (max_model_len), as vLLM refuses a
  max_tokens no prompt leaves room for; a protocol fits what remains after the prompt
  (protocols/checks.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from handlers.engine.types import GenerationRequest, RequestValidationError, SamplingParams

MAX_TEMPERATURE = 1e6
REPETITION_PENALTY = (1e-6, 1e6)
OPENAI_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
SEED = (-(2**63), 2**64 - 1)


def check_limits(request: GenerationRequest, vocab_size: int, max_model_len: int) -> None:
    """Refuse (RequestValidationError naming the field) a setting no engine can run."""
    params = request.params
    for field, ok, rule in _float_rules(params) + _integer_rules(params, max_model_len):
        if not ok:  # the protocol's refusal names the field
            raise RequestValidationError(field, rule)
    ids = [("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids),
           ("inputs", request.prompt_token_ids or ())]
    for field, tokens in ids:
        if (bad := _unknown(tokens, vocab_size)) is not None:
            raise RequestValidationError(
                field, f"token id {bad} is not in the vocabulary (ids 0 to {vocab_size - 1})")


def _float_rules(params: SamplingParams) -> list[tuple[str, bool, str]]:
    low, high = REPETITION_PENALTY
    return [
        ("temperature", _within(params.temperature, 0, MAX_TEMPERATURE),
         f"must be in [0, {MAX_TEMPERATURE:g}]"),
        ("top_p", _finite(params.top_p) and 0 < params.top_p <= 1, "must be in (0, 1]"),
        ("typical_p", _finite(params.typical_p) and 0 < params.typical_p <= 1,
         "must be in (0, 1]"),
        ("min_p", _within(params.min_p, 0, 1), "must be in [0, 1]"),
        ("repetition_penalty", _within(params.repetition_penalty, low, high),
         f"must be in [{low:g}, {high:g}]"),
        ("presence_penalty", _within(params.presence_penalty, -OPENAI_PENALTY, OPENAI_PENALTY),
         f"must be in [-{OPENAI_PENALTY:g}, {OPENAI_PENALTY:g}]"),
        ("frequency_penalty", _within(params.frequency_penalty, -OPENAI_PENALTY, OPENAI_PENALTY),
         f"must be in [-{OPENAI_PENALTY:g}, {OPENAI_PENALTY:g}]"),
        ("logit_bias", all(_within(bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
                           for bias in params.logit_bias.values()),
         f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
    ]


def _integer_rules(params: SamplingParams, max_model_len: int) -> list[tuple[str, bool, str]]:
    context = f"must be at most the model's context, {max_model_len} tokens"
    return [
        ("max_new_tokens", params.max_new_tokens <= max_model_len, context),
        ("min_new_tokens", params.min_new_tokens <= max_model_len, context),
        ("seed", params.seed is None or SEED[0] <= params.seed <= SEED[1],
         "must be a 64-bit integer"),
    ]


def _finite(value: float) -> bool:
    return math.isfinite(value)


def _within(value: float, low: float, high: float) -> bool:
    return math.isfinite(value) and low <= value <= high


def _unknown(tokens: Iterable[int], vocab_size: int) -> int | None:
    return next((token for token in tokens if not 0 <= token < vocab_size), None)
