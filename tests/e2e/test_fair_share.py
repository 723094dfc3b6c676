"""Requests share the batch: on the real server (SmolLM2, a batch of 4), one completions request
of 24 prompts is running when a bystander asks for one completion, and the bystander's first
token comes before the big request's 8th sequence finishes, where first come first served
would put it behind all 24. Judged by the order the two streams' events arrive in, never by a
clock."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import orjson
import pytest
from server_process import running_server

pytestmark = pytest.mark.e2e

BATCH = 4
PROMPTS = 24
BEFORE = 8  # two batches' worth: first come first served reaches it only after 20


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("fair") / "server.log"
    with running_server(f"option.max_rolling_batch_size={BATCH}", "option.max_model_len=256",
                        "option.embedding_model_id=none", log_path=log) as served:
        yield served


def chunks(line: str) -> list[dict]:
    """The choices of one SSE line of a completions stream (none for other lines)."""
    if not line.startswith("data: {"):
        return []
    return orjson.loads(line.removeprefix("data: "))["choices"]


async def test_a_bystanders_first_token_does_not_wait_for_a_big_requests_batch(url):
    # Sixteen tokens each: a batch of the big request runs long enough for the bystander to
    # reach the engine while the first batch runs, however slowly its request is read.
    big = {"prompt": [f"Count from {i} to" for i in range(PROMPTS)], "max_tokens": 16,
           "ignore_eos": True, "temperature": 0, "stream": True}
    bystander = {"prompt": "The capital of France is", "max_tokens": 2, "stream": True}
    finished = 0  # the big request's sequences finished, as its stream has told so far
    async with httpx.AsyncClient(base_url=url, timeout=300) as http, \
            http.stream("POST", "/v1/completions", json=big) as stream:
        assert stream.status_code == 200  # its first token came: all 24 are in the engine
        lines = stream.aiter_lines()

        async def read_big() -> None:
            nonlocal finished
            async for line in lines:
                finished += sum(c["finish_reason"] is not None for c in chunks(line))

        reading = asyncio.create_task(read_big())
        finished_at_first = None  # `finished` when the bystander's first token arrived
        async with http.stream("POST", "/v1/completions", json=bystander) as other:
            async for line in other.aiter_lines():
                if chunks(line) and finished_at_first is None:
                    finished_at_first = finished
        await reading
    assert finished_at_first is not None and finished_at_first < BEFORE, finished_at_first
    assert finished == PROMPTS
