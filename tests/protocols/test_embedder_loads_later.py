"""Beside a generation model, the embedding model loads while the server already answers: /ping
does not wait for it, its requests wait until it has loaded, and a failed load turns /ping off
and answers its requests with the reason (the fake engines; the real server's order of events
is checked in test_embeddings_server.py). A bad embedding model id still fails the start."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
from fakes import FakeEmbeddingEngine, FakeEngine
from server_process import free_port

from handlers.server.app import create_app
from handlers.server.context import Served, ServerContext, ServerSettings

EMBEDDER = "all-minilm-l6-v2"
BODY = {"model": EMBEDDER, "input": ["one two three"]}


def _server() -> tuple[httpx.AsyncClient, Served]:
    later = Served(EMBEDDER, loads_later=True)
    ctx = ServerContext(ServerSettings("fake-model"), Served("fake-model", FakeEngine()), later)
    app = create_app(ctx)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t"), later


async def test_ping_answers_while_it_loads_and_its_requests_wait_for_it() -> None:
    client, later = _server()
    async with client:
        assert (await client.get("/ping")).status_code == 200
        asked = asyncio.ensure_future(client.post("/v1/embeddings", json=BODY))
        for _ in range(20):  # the request is in, and parked: nothing can answer it yet
            await asyncio.sleep(0)
        assert not asked.done()
        later.attach(FakeEmbeddingEngine(model_name=EMBEDDER))
        answer = await asked
        assert answer.status_code == 200, answer.text
        assert answer.json()["data"][0]["embedding"] == [3.0, 13.0, 0.5, -1.0]
        kserve = await client.post(f"/v1/models/{EMBEDDER}:predict",
                                   json={"instances": ["a b"]})
        assert kserve.json() == {"predictions": [[2.0, 3.0, 0.5, -1.0]]}


async def test_a_failed_load_turns_ping_off_and_answers_with_the_reason() -> None:
    client, later = _server()
    async with client:
        asked = asyncio.ensure_future(client.post("/v1/embeddings", json=BODY))
        for _ in range(20):
            await asyncio.sleep(0)
        later.load_error = "no such model directory"
        answer = await asked
        assert answer.status_code == 503
        assert "not loaded (no such model directory)" in answer.json()["error"]["message"]
        assert (await client.get("/ping")).status_code == 503
        kserve = await client.post(f"/v1/models/{EMBEDDER}:predict",
                                   json={"instances": ["a b"]})
        assert kserve.status_code == 503 and "no such model directory" in kserve.text


def test_a_bad_embedding_model_id_fails_the_start(tmp_path: Path) -> None:
    """The embedding model's files are located while the model loads: a directory that holds
    no model stops the server before /ping ever says 200, naming it."""
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "handlers.cli", "--host", "127.0.0.1", "--port",
         str(free_port()), "--grpc-port", "0", "--option", f"option.embedding_model_id={empty}"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 1
    assert f"{empty} holds no config.json" in done.stdout  # logs go to stdout
    assert "is ready" not in done.stdout
