"""`option.predict_timeout` (a request's deadline) and `job_queue_size` (how many requests the
server holds at once), on every protocol, over the FakeEngine (tests/fakes.py)."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import orjson
import pytest
from fakes import FakeEngine, served_app

SLOW = {"inputs": "a b", "parameters": {"max_new_tokens": 60}}  # 60 steps of token_delay
CHAT = {"messages": [{"role": "user", "content": "a b"}]}  # up to the context: 58 steps


def client(engine: FakeEngine, **settings) -> httpx.AsyncClient:
    app = served_app(engine, **settings)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://lmi")


async def test_a_request_past_its_deadline_is_answered_408_and_aborted():
    engine = FakeEngine(token_delay=0.01)
    async with client(engine, predict_timeout=0.05) as http:
        lmi = await http.post("/invocations", json=SLOW)
        chat = await http.post("/v1/chat/completions", json=CHAT)
    assert lmi.status_code == 408
    assert lmi.json()["error"] == ("the request ran past its deadline of 0.05 s "
                                   "(option.predict_timeout)")
    assert lmi.json()["details"]["finish_reason"] == "error"
    assert chat.status_code == 408
    assert chat.json()["error"]["message"].startswith("generation failed: the request ran past")
    assert [r.request_id for r in engine.requests] == engine.aborted


async def test_a_stream_past_its_deadline_ends_with_the_error_line():
    engine = FakeEngine()
    stalls = {**SLOW, "inputs": "a b [[stall:3]]", "stream": True}  # 3 tokens, then no more
    async with client(engine, predict_timeout=0.05) as http:
        response = await http.post("/invocations", json=stalls)
    lines = [orjson.loads(line) for line in response.text.splitlines()]
    assert response.status_code == 200 and len(lines) == 3 + 1  # the tokens, then the error
    assert lines[-1]["details"]["finish_reason"] == "error"
    assert all(line["token"]["id"] != -1 for line in lines[:-1])
    assert engine.aborted == [engine.requests[0].request_id]


async def test_without_a_deadline_a_long_request_runs_to_its_end():
    engine = FakeEngine()
    async with client(engine) as http:
        response = await http.post("/invocations", json=SLOW)
    assert response.status_code == 200 and len(response.json()["generated_text"].split()) == 60


@pytest.mark.parametrize(("path", "body", "error"), [
    ("/invocations", {"inputs": "c"}, lambda r: r.json()["error"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "c"}]},
     lambda r: r.json()["error"]["message"]),
])
async def test_a_request_over_job_queue_size_is_refused_at_once_with_retry_after(path, body,
                                                                                 error):
    engine = FakeEngine(token_delay=0.05)
    async with client(engine, job_queue_size=1) as http:
        held = asyncio.create_task(http.post("/invocations", json=SLOW))
        await engine.until(lambda: bool(engine.requests))
        refused = await http.post(path, json=body)
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert error(refused) == ("the server is at its limit of 1 sequences (job_queue_size): "
                              "1 are held and this request asks for 1; retry later")
    assert len(engine.requests) == 1  # the refused request never reached the engine


async def test_job_queue_size_counts_a_requests_sequences_not_the_request():
    engine = FakeEngine()
    stalled = {"prompt": ["a b [[stall:1]]"] * 3, "max_tokens": 5}  # 3 sequences, held
    async with client(engine, job_queue_size=4) as http:
        held = asyncio.create_task(http.post("/v1/completions", json=stalled))
        await engine.until(lambda: len(engine.requests) == 3)
        two = await http.post("/v1/completions", json={"prompt": "c", "n": 2, "max_tokens": 2})
        one = await http.post("/invocations", json={"inputs": "c d"})
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held
        await engine.until(lambda: len(engine.aborted) == 3)
        after = await http.post("/v1/completions", json={"prompt": ["c"] * 4, "max_tokens": 2})
    assert two.status_code == 503 and two.headers["retry-after"] == "1"
    assert two.json()["error"]["message"] == (
        "the server is at its limit of 4 sequences (job_queue_size): 3 are held and this "
        "request asks for 2; retry later")
    assert one.status_code == 200  # the fourth sequence still fits
    assert after.status_code == 200  # the stalled request gave its three back


async def test_a_finished_request_gives_its_place_back():
    engine = FakeEngine()
    async with client(engine, job_queue_size=1) as http:
        answers = [await http.post("/invocations", json={"inputs": "a"}) for _ in range(3)]
        failed = await http.post("/invocations", json={"inputs": "a [[error:1]]"})
        after = await http.post("/invocations", json={"inputs": "b", "stream": True})
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert failed.status_code == 424 and after.status_code == 200
