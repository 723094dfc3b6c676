"""The event loop only schedules: a request whose tokenizing (or chat template) takes long, as a
5 MB prompt's does, holds a worker, never the loop, so `/ping` and other requests are answered
meanwhile. The fake tokenizer here blocks inside `encode` until the test lets it go: while it
does, the server must still answer."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from fakes import HANG_GUARD_S, FakeEngine, FakeTokenizer, served_app
from server_process import serving

MODEL = "fake-model"
BLOCK = "BLOCK_IN_ENCODE"  # a prompt holding it blocks its tokenizing


class BlockingTokenizer(FakeTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if BLOCK in text:
            self.entered.set()
            assert self.release.wait(HANG_GUARD_S), "the test never released the tokenizer"
        return super().encode(text, add_special_tokens)


@pytest.fixture
def blocked() -> BlockingTokenizer:
    return BlockingTokenizer()


@pytest.fixture
def url(blocked: BlockingTokenizer):
    with serving(served_app(FakeEngine(tokenizer=blocked))) as base:
        yield base


CHAT = {"messages": [{"role": "user", "content": f"a {BLOCK}"}], "max_tokens": 2}
SLOW_REQUESTS = [
    ("/tokenize", {"prompt": f"a {BLOCK}"}),
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"prompt": f"a {BLOCK}", "max_tokens": 2}),
    ("/invocations", {"inputs": f"a {BLOCK}", "parameters": {"max_new_tokens": 2}}),
    ("/v1/messages", {**CHAT, "model": MODEL}),
    ("/v1/messages/count_tokens", {**CHAT, "model": MODEL}),
    ("/v1/responses", {"input": f"a {BLOCK}", "max_output_tokens": 2}),
    (f"/v2/models/{MODEL}/generate", {"text_input": f"a {BLOCK}"}),
]


@pytest.mark.parametrize(("route", "body"), SLOW_REQUESTS)
def test_while_one_request_tokenizes_the_server_answers_others(url, blocked, route, body):
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(httpx.post, f"{url}{route}", json=body, timeout=HANG_GUARD_S)
        assert blocked.entered.wait(HANG_GUARD_S)  # it is tokenizing now, and stays there
        try:
            ping = httpx.get(f"{url}/ping", timeout=HANG_GUARD_S)
            other = httpx.post(f"{url}/invocations", timeout=HANG_GUARD_S,
                               json={"inputs": "b c", "parameters": {"max_new_tokens": 2}})
            assert not slow.done()
        finally:
            blocked.release.set()
        answered: Any = slow.result()
    assert ping.status_code == 200 and other.status_code == 200
    assert answered.status_code == 200, answered.text
