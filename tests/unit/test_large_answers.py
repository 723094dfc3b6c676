"""Large JSON answers (thousands of embeddings, long logprobs) are encoded in a worker thread, a
piece at a time, so the event loop keeps answering while one is encoded; the bytes are those
orjson gives for the whole object."""

from __future__ import annotations

import threading

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from handlers.server import framing
from handlers.server.framing import Reply
from handlers.server.http.answers import json_response

SCALARS = st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) \
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=12)
                    | st.dictionaries(st.text(max_size=4), inner, max_size=6), max_leaves=60)


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_pieces_are_the_whole_encoding(value) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(framing, "PIECE_WEIGHT", 3)  # tiny pieces: every path is taken
        reply = Reply(200, value, tail=b"\x00\x01")
        assert reply.body_in_pieces() == reply.body


def embeddings(count: int) -> dict:
    return {"object": "list", "model": "m", "usage": {"prompt_tokens": count},
            "data": [{"object": "embedding", "index": i, "embedding": [i / 7] * 384}
                     for i in range(count)]}


def test_small_answers_are_not_large_and_many_embeddings_are() -> None:
    assert not Reply(200, embeddings(4)).large
    assert not Reply(200, {"text": "x" * 1_000_000}).large  # one string: orjson copies it fast
    assert Reply(200, embeddings(2048)).large


def test_a_large_answer_is_encoded_off_the_event_loop(monkeypatch) -> None:
    threads: list[int] = []
    encode = Reply.body_in_pieces

    def recorded(reply: Reply) -> bytes:
        threads.append(threading.get_ident())
        return encode(reply)

    monkeypatch.setattr(Reply, "body_in_pieces", recorded)
    content = embeddings(2048)
    loop_thread: list[int] = []

    async def route(_request):
        loop_thread.append(threading.get_ident())
        return json_response(Reply(200, content, {"X-Kept": "1"}))

    with TestClient(Starlette(routes=[Route("/", route)])) as client:
        answer = client.get("/")
    assert answer.status_code == 200 and answer.headers["x-kept"] == "1"
    assert answer.headers["content-type"] == "application/json"
    assert orjson.loads(answer.content) == content
    assert len(threads) == 1 and threads != loop_thread
