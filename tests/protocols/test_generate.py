"""Triton/MindIE generate and generate_stream over HTTP: on the FakeEngine (its answer
echoes the prompt's words, one token per step) and, for priority, on the torch engine with a
tiny model and one batch slot."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from fakes import FakeEngine, served_app
from server_process import serving

from handlers.engine.torch.engine import TorchEngine
from handlers.engine.torch.loader import load_model
from handlers.server.app import create_app
from handlers.server.context import Served, ServerContext, ServerSettings

MODEL = "fake-model"
GENERATE = f"/v2/models/{MODEL}/generate"
STREAM = f"/v2/models/{MODEL}/generate_stream"
BODY = {"id": "a123", "text_input": "a b c",
        "parameters": {"max_new_tokens": 4, "details": True}}


def client(engine: FakeEngine | None = None, **settings) -> httpx.AsyncClient:
    app = served_app(engine or FakeEngine(), **settings)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def events(response: httpx.Response) -> list[dict]:
    chunks = response.text.split("\n\n")
    assert chunks[-1] == "" and all(c.startswith("data:{") for c in chunks[:-1])  # MindIE's framing
    return [orjson.loads(c.removeprefix("data:")) for c in chunks[:-1]]


async def test_generate_answers_whole_with_details():
    async with client() as http:
        response = await http.post(GENERATE, json=BODY)
    answer = response.json()
    assert response.status_code == 200
    assert (answer["id"], answer["model_name"], answer["model_version"]) == ("a123", MODEL, None)
    assert answer["text_output"] == " a b c a"
    details = answer["details"]
    assert (details["finish_reason"], details["generated_tokens"]) == ("length", 4)
    assert isinstance(details["batch_size"], int) and details["queue_wait_time"] >= 0
    assert details["first_token_cost"] is None and details["decode_cost"] is None
    assert answer["prefill_time"] >= 0 and answer["decode_time"] >= 0


async def test_generate_stream_sends_one_event_per_token():
    async with client() as http:
        whole = (await http.post(GENERATE, json=BODY)).json()
        response = await http.post(STREAM, json=BODY)
    assert response.headers["content-type"].startswith("text/event-stream")
    got = events(response)
    assert [e["details"]["generated_tokens"] for e in got] == [1, 2, 3, 4]
    assert "".join(e["text_output"] for e in got) == whole["text_output"]
    assert ["finish_reason" in e["details"] for e in got] == [False, False, False, True]
    assert got[-1]["details"]["finish_reason"] == "length"
    assert got[0]["prefill_time"] >= 0 and got[0]["decode_time"] is None
    assert all(e["prefill_time"] is None and e["decode_time"] >= 0 for e in got[1:])
    assert all(e["id"] == "a123" and e["model_name"] == MODEL for e in got)


async def test_details_are_left_out_unless_asked_and_perf_stat_measures():
    async with client() as http:
        plain = await http.post(STREAM, json={"text_input": "a", "parameters": {
            "max_new_tokens": 2}})
        perf = await http.post(GENERATE, json={"text_input": "a b", "parameters": {
            "max_new_tokens": 3, "details": True, "perf_stat": True}})
    assert all("details" not in e and e["id"] is None for e in events(plain))
    details = perf.json()["details"]
    assert details["first_token_cost"] >= 0 and details["decode_cost"] >= 0


async def test_full_text_sends_the_whole_text_so_far():
    async with client(full_text_enabled=True) as http:
        response = await http.post(STREAM, json=BODY)
    assert [e["text_output"] for e in events(response)] == [" a", " a b", " a b c", " a b c a"]


async def test_an_eos_ends_with_eos_token_and_the_version_route_names_the_version():
    async with client() as http:
        response = await http.post(f"/v2/models/{MODEL}/versions/1/generate_stream", json={
            "text_input": "a [[eos:1]]", "parameters": {"details": True}})
    got = events(response)
    assert got[-1]["details"]["finish_reason"] == "eos_token"
    assert {e["model_version"] for e in got} == {"1"}


@pytest.mark.parametrize("path", [GENERATE, STREAM])
@pytest.mark.parametrize(("parameters", "field"), [
    ({"max_new_tokens": 0}, "parameters.max_new_tokens"),
    ({"max_new_tokens": 2**31}, "parameters.max_new_tokens"),
    ({"max_new_tokens": "20"}, "parameters.max_new_tokens"),
    ({"repetition_penalty": 0}, "parameters.repetition_penalty"),
    ({"seed": 0}, "parameters.seed"),
    ({"seed": 2**64}, "parameters.seed"),
    ({"temperature": 0}, "parameters.temperature"),
    ({"top_k": -1}, "parameters.top_k"),
    ({"top_p": 1.5}, "parameters.top_p"),
    ({"top_p": 0}, "parameters.top_p"),
    ({"typical_p": 0}, "parameters.typical_p"),
    ({"batch_size": 0}, "parameters.batch_size"),
    ({"priority": 0}, "parameters.priority"),
    ({"priority": 6}, "parameters.priority"),
    ({"timeout": 0}, "parameters.timeout"),
    ({"timeout": 3601}, "parameters.timeout"),
    ({"details": "yes"}, "parameters.details"),
    ({"watermark": 1}, "parameters.watermark"),
])
async def test_out_of_range_parameters_are_400s_naming_them(path, parameters, field):
    async with client() as http:
        response = await http.post(path, json={"text_input": "a", "parameters": parameters})
    assert response.status_code == 400 and response.json()["error"].startswith(field)


@pytest.mark.parametrize(("body", "message"), [
    ({"text_input": ""}, "text_input: must not be empty"),
    ({"parameters": {}}, "text_input: Field required"),
    ({"text_input": [{"type": "text", "text": "hi"}, {"type": "image_url",
                                                       "image_url": "x.png"}]},
     "text_input: this model reads text only"),
    ({"id": "bad id!", "text_input": "a"}, "id: String should match pattern"),
    ({"id": "x" * 257, "text_input": "a"}, "id: String should have at most 256 characters"),
    (["a"], "the request body must be a JSON object"),
])
async def test_bad_requests_are_400s(body, message):
    async with client() as http:
        response = await http.post(STREAM, content=orjson.dumps(body))
    assert response.status_code == 400 and message in response.json()["error"]


async def test_broken_json_unknown_model_and_loading():
    async with client() as http:
        broken = await http.post(GENERATE, content=b"{nope")
        other = await http.post("/v2/models/other/generate", json={"text_input": "a"})
    async with client(loaded=False) as http:
        loading = await http.post(GENERATE, json={"text_input": "a"})
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]
    assert other.status_code == 404 and "not served here" in other.json()["error"]
    assert loading.status_code == 503 and "still loading" in loading.json()["error"]


async def test_timeout_ends_a_long_request_and_frees_its_slot():
    engine = FakeEngine()
    async with client(engine) as http:  # 5 tokens, then the engine stalls until aborted
        response = await http.post(STREAM, json={"text_input": "a [[stall:5]]", "parameters": {
            "max_new_tokens": 60, "timeout": 1}})
    got = events(response)
    assert got[-1] == {"error": "the request ran past its deadline of 1 s "
                                "(the request's timeout)"}
    assert len(got) == 5 + 1
    assert engine.aborted == [engine.requests[0].request_id]


async def test_a_failure_mid_stream_ends_with_an_error_event():
    async with client() as http:
        response = await http.post(STREAM, json={"text_input": "a [[error:2]]"})
        early = await http.post(STREAM, json={"text_input": "a [[error:0]]"})
    got = events(response)
    assert len(got) == 3 and got[-1] == {"error": "scripted error after 2 tokens"}
    assert early.status_code == 500 and early.json() == {"error": "scripted error after 0 tokens"}


# --- priority on the torch engine -----------------------------------------------------------


async def test_priority_reorders_a_saturated_queue(tiny_dir):
    """One batch slot, held by a long request; a later request of priority 1 is admitted before
    an earlier one of the default priority, 5."""
    engine = TorchEngine(load_model(tiny_dir, dtype="fp32", name="tiny"), max_batch_size=1)
    ctx = ServerContext(ServerSettings("tiny"), Served("tiny", engine))
    await engine.start()
    first_events: list[str] = []

    async def stream(http: httpx.AsyncClient, name: str, tokens: int, priority: int) -> None:
        body = {"id": name, "text_input": "Once upon a time", "parameters": {
            "max_new_tokens": tokens, "priority": priority}}
        async with http.stream("POST", "/v2/models/tiny/generate_stream", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:") and name not in first_events:
                    first_events.append(name)

    async def waiting(count: int) -> None:
        while engine.stats()["waiting_requests"] < count:
            await asyncio.sleep(0.01)

    try:  # over a socket: streams must arrive as they are made
        with serving(create_app(ctx)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                holder = asyncio.create_task(stream(http, "holder", 60, 5))
                while not first_events:
                    await asyncio.sleep(0.01)
                low = asyncio.create_task(stream(http, "low", 2, 5))
                await waiting(1)
                high = asyncio.create_task(stream(http, "high", 2, 1))
                await waiting(2)
                await asyncio.gather(holder, low, high)
    finally:
        await engine.shutdown()
    assert first_events == ["holder", "high", "low"]


async def test_stream_details_report_the_running_batch(tiny_dir):
    """Every event's `batch_size` is the batch that made its token: this request alone, 1 (the
    torch engine reported 0, on the first event too)."""
    engine = TorchEngine(load_model(tiny_dir, dtype="fp32", name="tiny"), max_batch_size=2)
    ctx = ServerContext(ServerSettings("tiny"), Served("tiny", engine))
    await engine.start()
    body = {"id": "b1", "text_input": "Once upon a time",
            "parameters": {"max_new_tokens": 5, "details": True}}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)),
                                     base_url="http://t", timeout=60) as http:
            got = events(await http.post("/v2/models/tiny/generate_stream", json=body))
            whole = (await http.post("/v2/models/tiny/generate", json=body)).json()
    finally:
        await engine.shutdown()
    assert got and [e["details"]["batch_size"] for e in got] == [1] * len(got)
    assert whole["details"]["batch_size"] == 1
