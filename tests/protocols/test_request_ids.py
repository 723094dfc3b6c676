"""Request ids, from a client's and an operator's side: every response, streamed or not, carries
`X-Request-Id` (SageMaker's inference id, else the caller's `X-Request-Id`, else KServe's body
`id`, else a fresh one) and echoes `X-Amzn-SageMaker-Inference-Id`; every log line written while
the request is served carries `[RequestId=...]`, whichever logger writes it."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
from fakes import FakeEmbeddingEngine, FakeEngine, served_app

from handlers.server.request_ids import install_log_ids, sanitize

SAGEMAKER = "X-Amzn-SageMaker-Inference-Id"
MODEL = "fake-model"
INFER = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["a"]}]}


@pytest.fixture
def engine() -> FakeEngine:
    """A fresh one per test, as its app: what a test's requests logged is theirs alone."""
    return FakeEngine()


@pytest.fixture
def app(engine: FakeEngine) -> Any:
    return served_app(engine, FakeEmbeddingEngine())


CASES = [
    ("POST", "/invocations", {"inputs": "a b"}),
    ("POST", "/invocations", {"inputs": "a b", "stream": True}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                      "stream": True}),
    ("POST", "/endpoints/e/invocations-response-stream", {"inputs": "a b", "stream": True}),
    ("POST", "/generate_stream", {"inputs": "a b"}),
    ("POST", "/v1/embeddings", {"input": "a"}),
    ("POST", "/invocations", {"inputs": "a", "parameters": {"top_p": 7}}),  # refused
    ("GET", "/ping", None),
    ("GET", "/no/such/route", None),
]


@pytest.mark.parametrize(("method", "path", "body"), CASES)
async def test_every_response_carries_a_fresh_id(client, method, path, body):
    response = await client.request(method, path, json=body)
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"])
    assert SAGEMAKER.lower() not in response.headers


@pytest.mark.parametrize(("method", "path", "body"), CASES)
async def test_sagemakers_inference_id_is_the_id_and_is_echoed(client, method, path, body):
    response = await client.request(method, path, json=body, headers={SAGEMAKER: "inf-7"})
    assert response.headers["x-request-id"] == "inf-7"
    assert response.headers[SAGEMAKER] == "inf-7"


async def test_a_callers_x_request_id_is_kept(client):
    response = await client.post("/invocations", json={"inputs": "a"},
                                 headers={"X-Request-Id": "trace-1"})
    assert response.headers["x-request-id"] == "trace-1"


async def test_kserves_body_id_is_the_id_unless_a_header_named_one(client):
    path = f"/v2/models/{MODEL}/infer"
    response = await client.post(path, json={"id": "kserve-9", **INFER})
    assert response.json()["id"] == "kserve-9"
    assert response.headers["x-request-id"] == "kserve-9"
    named = await client.post(path, json={"id": "kserve-9", **INFER}, headers={SAGEMAKER: "s"})
    assert named.headers["x-request-id"] == "s"


def test_a_callers_id_cannot_forge_log_lines():
    assert sanitize("a b\r\n[RequestId=x] forged") == "ab[RequestId=x]forged"
    assert sanitize("\n\t ") is None
    assert len(sanitize("x" * 1000)) == 128


async def test_log_lines_of_the_request_carry_its_id(client, caplog):
    with caplog.at_level(logging.INFO):
        await client.post("/invocations", json={"inputs": "a", "parameters": {"top_p": 7}},
                          headers={SAGEMAKER: "inf-42"})
    refused = [r for r in caplog.records if "request refused" in r.getMessage()]
    assert refused and all(r.getMessage().startswith("[RequestId=inf-42] ") for r in refused)
    assert all(r.request_id == "inf-42" for r in refused)


async def test_log_lines_from_deeper_layers_carry_it_too(engine, client, caplog, monkeypatch):
    """A logger the server knows nothing of, deep in the call (here: in the engine's output
    stream, which the generation driver reads), still writes the request's id, streamed
    answers included."""
    generate = engine.generate

    async def logging_generate(request):
        logging.getLogger("some.engine.module").warning("generating for %s", "a request")
        async for output in generate(request):
            yield output

    monkeypatch.setattr(engine, "generate", logging_generate)
    with caplog.at_level(logging.INFO):
        for stream in (False, True):
            response = await client.post("/v1/completions", headers={"X-Request-Id": "deep-1"},
                                         json={"prompt": "a", "max_tokens": 1, "stream": stream})
            assert response.status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "some.engine.module"]
    assert lines == ["[RequestId=deep-1] generating for a request"] * 2


def test_lines_outside_requests_are_untouched(caplog):
    install_log_ids()
    with caplog.at_level(logging.INFO):
        logging.getLogger("startup").info("loading %d%%", 50)
    assert caplog.records[-1].getMessage() == "loading 50%"
    assert caplog.records[-1].request_id == "-"


async def test_an_id_with_a_percent_sign_formats(client, caplog):
    with caplog.at_level(logging.INFO):
        await client.post("/invocations", json={"inputs": "a", "parameters": {"top_p": 7}},
                          headers={SAGEMAKER: "50%off"})
    assert any(r.getMessage().startswith("[RequestId=50%off] LMI request refused")
               for r in caplog.records)
