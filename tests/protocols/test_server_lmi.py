"""The LMI routes of the FastAPI app, against the FakeEngine (tests/fakes.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from fakes import FakeEngine, served_app
from server_process import serving_here

from handlers.server.context import ServerSettings

MODEL = "fake-model"


@pytest.fixture
def engine() -> FakeEngine:
    """A fresh one per test, as its app: tests script it and count what it served."""
    return FakeEngine()


@pytest.fixture
def app(engine: FakeEngine) -> Any:
    return served_app(engine, model_name=MODEL)


def client_for(engine: FakeEngine, **settings) -> httpx.AsyncClient:
    app = served_app(engine, model_name=MODEL, **settings)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://lmi")


async def invoke(client: httpx.AsyncClient, body: object, path: str = "/invocations"):
    return await client.post(path, content=orjson.dumps(body))


def lines(response: httpx.Response) -> list[dict]:
    return [orjson.loads(line) for line in response.text.splitlines() if line]


def events(response: httpx.Response) -> list[dict]:
    chunks = response.text.split("\n\n")
    assert chunks[-1] == ""
    assert all(c.startswith("data: ") for c in chunks[:-1])
    return [orjson.loads(c.removeprefix("data: ")) for c in chunks[:-1]]


# --- health and routes ----------------------------------------------------------------------


async def test_ping_is_503_until_the_engine_is_ready(engine, client):
    engine.ready = False
    response = await client.get("/ping")
    assert response.status_code == 503
    engine.ready = True
    response = await client.get("/ping")
    assert (response.status_code, response.json()) == (200, {"status": "Healthy"})


async def test_invocations_while_loading_is_503(engine):
    loading = httpx.ASGITransport(app=served_app(engine, loaded=False))
    async with httpx.AsyncClient(transport=loading, base_url="http://lmi") as client:
        response = await invoke(client, {"inputs": "hi"})
        chat = await invoke(client, {"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 503
    assert response.json() == {"error": "the model is still loading", "code": 503}
    assert chat.status_code == 503  # an OpenAI body gets OpenAI's error shape
    assert chat.json()["error"]["message"] == "the model is still loading"


@pytest.mark.parametrize("path", ["/invocations", f"/predictions/{MODEL}"])
async def test_generate_non_streaming(client, path):
    body = {"inputs": "Deep learning is", "parameters": {"max_new_tokens": 4}}
    response = await invoke(client, body, path)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.content == b'{"generated_text":" Deep learning is Deep"}'


async def test_unknown_model_is_404_in_lmi_shape(client):
    response = await invoke(client, {"inputs": "hi"}, "/predictions/other-model")
    assert response.status_code == 404
    assert response.json() == {
        "error": "model 'other-model' not found; this server serves 'fake-model'",
        "code": 404,
    }


async def test_details_with_prefill_and_top_tokens(client):
    params = {
        "max_new_tokens": 2,
        "details": True,
        "decoder_input_details": True,
        "top_n_tokens": 2,
    }
    response = await invoke(client, {"inputs": "a b", "parameters": params})
    details = response.json()["details"]
    assert details["finish_reason"] == "length"
    assert details["generated_tokens"] == 2
    assert details["inputs"] == "a b"
    assert [t["text"] for t in details["tokens"]] == [" a", " b"]
    assert [t["text"] for t in details["prefill"]] == ["a", "b"]
    assert [[t["text"] for t in top] for top in details["top_tokens"]] == [
        [" a", " alt1"],
        [" b", " alt1"],
    ]


async def test_best_of_returns_the_most_likely_sequence_first(client):
    params = {"max_new_tokens": 2, "n": 2, "details": True}
    response = await invoke(client, {"inputs": "a b c", "parameters": params})
    body = response.json()
    # The fake makes sequence 1 (echoing from the second word) the most likely.
    assert body["generated_text"] == " b c"
    assert [s["generated_text"] for s in body["details"]["best_of_sequences"]] == [" a b"]


# --- streaming formats ----------------------------------------------------------------------


async def test_stream_jsonlines_by_default(client):
    body = {"inputs": "x y", "parameters": {"max_new_tokens": 3, "details": True}, "stream": True}
    response = await invoke(client, body)
    assert response.headers["content-type"] == "application/jsonlines"
    got = lines(response)
    assert [g["token"]["text"] for g in got] == [" x", " y", " x"]
    assert "generated_text" not in got[0]
    assert got[-1]["generated_text"] == " x y x"
    assert got[-1]["details"] == {"finish_reason": "length", "generated_tokens": 3, "inputs": "x y"}


async def test_stream_sse_when_configured(engine):
    async with client_for(engine, output_formatter="sse") as client:
        body = {"inputs": "x", "parameters": {"max_new_tokens": 2}, "stream": True}
        response = await invoke(client, body, f"/predictions/{MODEL}")
    assert response.headers["content-type"].startswith("text/event-stream")
    got = events(response)
    assert [g["token"]["text"] for g in got] == [" x", " x"]
    assert got[-1]["generated_text"] == " x x"


async def test_stream_request_with_json_formatter_gets_one_json_body(engine):
    async with client_for(engine, output_formatter="json") as client:
        body = {"inputs": "x", "parameters": {"max_new_tokens": 2}, "stream": True}
        response = await invoke(client, body)
    assert response.json() == {"generated_text": " x x"}


async def test_tgi_compat_array_and_sse(engine):
    async with client_for(engine, tgi_compat=True) as client:
        plain = await invoke(client, {"inputs": "x", "parameters": {"max_new_tokens": 1}})
        body = {"inputs": "x", "parameters": {"max_new_tokens": 2}, "stream": True}
        streamed = await invoke(client, body)
    assert plain.json() == [
        {
            "generated_text": " x",
            "details": {
                "finish_reason": "length",
                "generated_tokens": 1,
                "inputs": "x",
                "tokens": [{"id": 10, "text": " x", "logprob": -1.0, "special": False}],
            },
        }
    ]
    got = events(streamed)
    assert got[0] == {
        "token": {"id": 10, "text": " x", "logprob": -1.0, "special": False},
        "generated_text": None,
        "details": None,
    }
    assert got[-1]["generated_text"] == " x x"


async def test_several_tokens_per_engine_step_stream_one_line_each(engine):
    engine.tokens_per_step = 3
    async with client_for(engine) as client:
        body = {"inputs": "p q", "parameters": {"max_new_tokens": 4}, "stream": True}
        got = lines(await invoke(client, body))
    assert [g["token"]["text"] for g in got] == [" p", " q", " p", " q"]
    assert [("generated_text" in g) for g in got] == [False, False, False, True]


async def test_eos_ends_the_stream_with_a_special_token(client):
    body = {"inputs": "x [[eos:1]]", "parameters": {"max_new_tokens": 5}, "stream": True}
    got = lines(await invoke(client, body))
    assert got[-1]["token"] == {"id": 2, "text": "", "log_prob": -1.0, "special_token": True}
    assert got[-1]["generated_text"] == " x"


# --- errors ---------------------------------------------------------------------------------

BAD_BODIES = [
    ({"parameters": {}}, "inputs: Field required"),
    ({"inputs": ""}, "inputs: String should have at least 1 character"),
    ({"inputs": ["a", "b"]}, "inputs: Input should be a valid string"),
    ([1, 2], "request body must be a JSON object"),
    ({"inputs": "a", "parameters": {"max_new_tokens": -1}}, "parameters.max_new_tokens: "),
    ({"inputs": "a", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens: "),
    ({"inputs": "a", "parameters": {"temperature": "abc"}}, "parameters.temperature: "),
    ({"inputs": "a", "parameters": {"top_p": 1.5}}, "parameters.top_p: "),
    ({"inputs": "a", "parameters": {"top_p": 0}}, "parameters.top_p: "),
    ({"inputs": "a", "parameters": {"top_k": -2}}, "parameters.top_k: "),
    ({"inputs": "a", "parameters": {"top_n_tokens": 99}}, "parameters.top_n_tokens: "),
    ({"inputs": "a", "parameters": {"stop": [1]}}, "parameters.stop"),
    ({"inputs": "a", "parameters": {"n": 3, "best_of": 2}}, "parameters.best_of: must be >= n"),
    ({"inputs": "a", "parameters": {"num_beams": 4}}, "parameters.num_beams: "),
    ({"inputs": "a", "parameters": {"n": 2}, "stream": True}, "parameters.n: "),
    ({"inputs": "a", "parameters": "hot"}, "parameters: "),
    ({"inputs": "a [[invalid]]"}, "inputs: the prompt carries the [[invalid]] marker"),
]


@pytest.mark.parametrize(("body", "message"), BAD_BODIES)
async def test_bad_requests_are_424_naming_the_field(client, body, message):
    response = await invoke(client, body)
    assert response.status_code == 424
    payload = response.json()
    assert payload["code"] == 424
    assert payload["error"].startswith(message)


async def test_malformed_json_is_424(client):
    response = await client.post("/invocations", content=b'{"inputs": "a",')
    assert response.status_code == 424
    assert response.json()["error"].startswith("request body is not valid JSON")


async def test_a_body_that_is_not_utf8_says_where(client):
    response = await client.post("/invocations", content=b'{"inputs": "caf\xe9"}')
    assert response.status_code == 424
    assert response.json()["error"] == ("request body is not valid JSON: it is not UTF-8 from "
                                        "byte 15 on (0xe9: invalid continuation byte)")


async def test_prompt_over_the_context_is_424(client):
    response = await invoke(client, {"inputs": "w " * 100})
    assert response.status_code == 424
    assert response.json()["error"] == "inputs: the prompt has 100 tokens, more than 64"


async def chunked(body: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(body), 64):
        yield body[start : start + 64]


@pytest.mark.parametrize("declared", [True, False])
async def test_body_over_the_size_limit_is_413(engine, declared):
    body = orjson.dumps({"inputs": "x" * 200})
    async with client_for(engine, max_request_size=100) as client:
        content = body if declared else chunked(body)  # with / without a Content-Length
        response = await client.post("/invocations", content=content)
    assert response.status_code == 413
    assert response.json() == {
        "error": "request body is larger than the limit of 100 bytes",
        "code": 413,
    }


async def test_error_after_tokens_ends_the_stream_with_the_error_line(client):
    body = {"inputs": "a b [[raise:2]]", "parameters": {"max_new_tokens": 5}, "stream": True}
    response = await invoke(client, body)
    assert response.status_code == 200
    got = lines(response)
    assert [g["token"]["text"] for g in got[:2]] == [" a", " b"]
    assert got[2:] == [
        {
            "token": {"id": -1, "text": "", "log_prob": -1, "special_token": True},
            "generated_text": "",
            "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None},
        }
    ]


async def test_error_finish_mid_stream_ends_with_the_error_line(client):
    body = {"inputs": "a [[error:1]]", "stream": True}
    got = lines(await invoke(client, body))
    assert len(got) == 2
    assert got[-1]["details"]["finish_reason"] == "error"


@pytest.mark.parametrize("marker", ["[[raise:0]]", "[[error:0]]"])
async def test_stream_failing_before_any_token_gets_an_http_error(client, marker):
    response = await invoke(client, {"inputs": f"a {marker}", "stream": True})
    assert response.status_code == 424
    assert response.json()["details"]["finish_reason"] == "error"


@pytest.mark.parametrize("marker", ["[[raise:1]]", "[[error:1]]"])
async def test_non_streaming_failure_is_424_with_the_seed_error_body(client, marker):
    response = await invoke(client, {"inputs": f"a {marker}"})
    assert response.status_code == 424
    body = response.json()
    assert body["generated_text"] == ""
    assert body["details"] == {
        "finish_reason": "error",
        "generated_tokens": None,
        "inputs": None,
        "tokens": None,
    }
    assert "after 1 tokens" in body["error"]


async def test_server_still_serves_after_bad_requests(client):
    for body, _ in BAD_BODIES:
        await invoke(client, body)
    await client.post("/invocations", content=b"{oops")
    await invoke(client, {"inputs": "a [[raise:1]]", "stream": True})
    response = await invoke(client, {"inputs": "ok", "parameters": {"max_new_tokens": 1}})
    assert response.json() == {"generated_text": " ok"}


async def test_unexpected_server_error_is_500_and_the_server_goes_on(engine, client):
    def broken(request):
        raise KeyError("bug")

    engine.validate = broken
    response = await invoke(client, {"inputs": "a"})
    assert (response.status_code, response.json()) == (
        500,
        {"error": "internal server error", "code": 500},
    )
    del engine.validate  # the class's own validate again
    assert (await invoke(client, {"inputs": "a"})).status_code == 200


def test_settings_refuse_an_unknown_output_formatter():
    with pytest.raises(ValueError, match="option.output_formatter"):
        ServerSettings(model_name=MODEL, output_formatter="xml")


async def test_request_id_header_appears_in_logs(client, caplog):
    caplog.set_level(logging.INFO, logger="handlers")
    headers = {"X-Amzn-SageMaker-Inference-Id": "sm-req-42"}
    await client.post("/invocations", content=b'{"inputs": "a"}', headers=headers)
    assert any("sm-req-42" in r.getMessage() for r in caplog.records)


# --- parameters reach the engine ------------------------------------------------------------


async def sent_params(client, engine, parameters: dict):
    response = await invoke(client, {"inputs": "a", "parameters": parameters})
    assert response.status_code == 200, response.text
    return engine.requests[-1].params


@pytest.mark.parametrize(
    ("parameters", "sampling"),
    [
        ({}, False),
        ({"temperature": 0.7}, True),
        ({"temperature": 1.0}, False),
        ({"temperature": 0}, False),
        ({"temperature": 0, "do_sample": True}, False),
        ({"top_k": 50}, True),
        ({"top_k": -1}, False),
        ({"top_p": 0.9}, True),
        ({"typical_p": 0.5}, True),
        ({"min_p": 0.1}, True),
        ({"do_sample": True}, True),
        ({"do_sample": False, "temperature": 0.7, "top_p": 0.5}, False),
    ],
)
async def test_do_sample_decides_else_sampling_parameters_ask(client, engine, parameters, sampling):
    assert (await sent_params(client, engine, parameters)).do_sample is sampling


async def test_defaults_reach_the_engine(client, engine):
    params = await sent_params(client, engine, {})
    assert (params.max_new_tokens, params.do_sample, params.temperature) == (30, False, 1.0)
    assert (params.n, params.best_of, params.top_logprobs) == (1, None, 0)
    assert (params.prompt_logprobs, params.stop_sequences) == (False, [])


async def test_lmi_names_map_to_engine_parameters(client, engine):
    params = await sent_params(
        client,
        engine,
        {
            "max_new_tokens": 3,
            "ignore_eos_token": True,
            "top_n_tokens": 3,
            "decoder_input_details": True,
            "stop_sequences": ["END"],
            "stop": "STOP",
            "stop_token_ids": [7],
            "truncate": 5,
            "seed": "42",
            "repetition_penalty": 1.2,
            "top_k": -1,
            "best_of": 3,
            "watermark": True,
        },
    )
    assert params.max_new_tokens == 3
    assert params.ignore_eos is True
    assert params.top_logprobs == 3
    assert params.prompt_logprobs is True
    assert params.stop_sequences == ["END", "STOP"]
    assert params.stop_token_ids == [7]
    assert params.truncate == 5
    assert params.seed == 42
    assert params.repetition_penalty == 1.2
    assert params.top_k == 0
    assert (params.n, params.best_of) == (3, 3)


# --- disconnects, over a real socket --------------------------------------------------------


@pytest.fixture
async def live_url(engine: FakeEngine) -> AsyncIterator[str]:
    async with serving_here(served_app(engine, model_name=MODEL)) as url:
        yield url


LONG = {"inputs": "a b", "parameters": {"max_new_tokens": 60}}


async def test_disconnect_mid_stream_aborts_the_request(engine, live_url):
    engine.token_delay = 0.01
    async with httpx.AsyncClient(base_url=live_url) as client:
        request = client.build_request("POST", "/invocations", json={**LONG, "stream": True})
        response = await client.send(request, stream=True)
        first = await anext(response.aiter_lines())
        await response.aclose()  # hang up mid-stream
    assert orjson.loads(first)["token"]["text"] == " a"
    rid = engine.requests[-1].request_id
    await engine.until(lambda: rid in engine.aborted)
    assert engine.generated[rid] < 60  # it did not run to its end


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_before_the_first_token_aborts(engine, live_url, stream):
    body = {**LONG, "inputs": "a b [[stall:0]]", "stream": stream}  # no token, ever
    async with httpx.AsyncClient(base_url=live_url) as client:
        pending = asyncio.create_task(client.post("/invocations", json=body))
        await engine.until(lambda: bool(engine.requests))
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
    rid = engine.requests[-1].request_id
    await engine.until(lambda: rid in engine.aborted)
    assert engine.generated[rid] == 0  # aborted before any token


async def test_metrics_expose_the_engine_counters():
    engine = FakeEngine()
    app = served_app(engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as client:
        await client.post("/invocations", json={"inputs": "a b c"})
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert 'lmi_finished_requests_total{model="fake-model"} 1.0' in response.text
    assert 'lmi_running_requests{model="fake-model"} 0.0' in response.text
