"""What no engine can run is refused before admission, on every route, in the route's own
shape and status, naming the field (engine/limits.py); the engine never sees it. The fake
engine's context is 64 tokens and its vocabulary 100,000 ids."""

from __future__ import annotations

import pytest

MODEL = "fake-model"
HUGE = 1e308  # past float32: the sampler could not even hold it

LMI = "/invocations"
TGI = "/generate"
GENERATE = f"/v2/models/{MODEL}/generate"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def lmi(**parameters) -> dict:
    return {"inputs": "a b", "parameters": parameters}


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "a b"}], **fields}


CASES = [
    (LMI, lmi(repetition_penalty=HUGE), 424, "repetition_penalty"),
    (LMI, lmi(repetition_penalty=1e-300), 424, "repetition_penalty"),
    (LMI, lmi(temperature=HUGE, do_sample=True), 424, "temperature"),
    (LMI, lmi(max_new_tokens=10**9), 424, "max_new_tokens"),
    (LMI, lmi(max_new_tokens=2**62), 424, "max_new_tokens"),
    (LMI, lmi(stop_token_ids=[2**63]), 424, "stop_token_ids"),
    (TGI, lmi(repetition_penalty=HUGE), 422, "repetition_penalty"),
    (TGI, lmi(max_new_tokens=10**9), 422, "max_new_tokens"),
    (GENERATE, {"text_input": "a b", "parameters": {"repetition_penalty": HUGE}}, 400,
     "repetition_penalty"),
    (GENERATE, {"text_input": "a b", "parameters": {"max_new_tokens": 2**62}}, 400,
     "max_new_tokens"),
    (CHAT, chat(stop_token_ids=[2**63]), 400, "stop_token_ids"),
    (CHAT, chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
    (COMPLETIONS, {"prompt": "a b", "stop_token_ids": [100_000]}, 400, "stop_token_ids"),
    (COMPLETIONS, {"prompt": "a b", "logit_bias": {"5": 1e30}}, 400, "logit_bias"),
]


@pytest.mark.parametrize(("route", "body", "status", "field"), CASES)
async def test_what_no_engine_can_run_is_refused_naming_the_field(client, engine, route, body,
                                                                  status, field):
    submitted = len(engine.requests)
    response = await client.post(route, json=body)
    assert response.status_code == status, response.text
    assert field in response.text
    assert len(engine.requests) == submitted  # refused before the engine saw it


async def test_the_same_request_within_the_limits_is_answered(client):
    response = await client.post(LMI, json=lmi(repetition_penalty=1.3, max_new_tokens=8,
                                               stop_token_ids=[7]))
    assert response.status_code == 200 and response.json()["generated_text"]
