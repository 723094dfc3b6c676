"""engine/limits.py: the settings no engine can run, each refused naming its field, and the
edges of each range accepted."""

from __future__ import annotations

import pytest

from handlers.engine.limits import check_limits
from handlers.engine.types import GenerationRequest, RequestValidationError, SamplingParams

VOCAB = 1000
CONTEXT = 64


def check(prompt_token_ids: list[int] | None = None, **params) -> None:
    request = GenerationRequest("a", SamplingParams(**params), prompt_token_ids=prompt_token_ids)
    check_limits(request, VOCAB, CONTEXT)


@pytest.mark.parametrize(("params", "field"), [
    ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 1e30}}, "logit_bias"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"typical_p": 1.5}, "typical_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 1e308}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": 1e308}, "temperature"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -1e9}, "frequency_penalty"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"max_new_tokens": CONTEXT + 1}, "max_new_tokens"),
    ({"max_new_tokens": 2**62}, "max_new_tokens"),
    ({"min_new_tokens": 10**9}, "min_new_tokens"),
    ({"prompt_token_ids": [1, VOCAB]}, "inputs"),
])
def test_what_no_engine_can_run_is_refused_naming_its_field(params: dict, field: str) -> None:
    with pytest.raises(RequestValidationError) as error:
        check(**params)
    assert error.value.field == field
    assert error.value.message.startswith(("must", "values must", "token id"))


@pytest.mark.parametrize("params", [
    {},
    {"temperature": 0.0}, {"temperature": 1e6}, {"repetition_penalty": 1e-6},
    {"repetition_penalty": 1e6}, {"presence_penalty": -2.0}, {"frequency_penalty": 2.0},
    {"top_p": 1.0}, {"min_p": 1.0}, {"seed": 2**64 - 1}, {"seed": -(2**63)},
    {"logit_bias": {0: -100.0, VOCAB - 1: 100.0}}, {"stop_token_ids": [0, VOCAB - 1]},
    {"max_new_tokens": CONTEXT}, {"prompt_token_ids": [0, VOCAB - 1]},
])
def test_the_edges_of_each_range_are_accepted(params: dict) -> None:
    check(**params)
