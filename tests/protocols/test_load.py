"""Load: many concurrent streams over every streaming HTTP protocol, none lost or corrupted
(FakeEngine: each answer echoes its own prompt's words, so a token that went to the wrong stream
shows), and on the real SmolLM2, 32 concurrent greedy streams equal to the answers without
streaming."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest
from botocore.eventstream import EventStreamBuffer
from fakes import FakeEngine, served_app
from server_process import running_server, serving

from handlers.engine.machine import has_native_bf16

STREAMS = 500
TOKENS = 12


def sse_data(raw: bytes) -> list[dict]:
    events = [e.split(b"data:", 1)[1].strip() for e in raw.split(b"\n\n") if e.strip()]
    return [orjson.loads(e) for e in events if e != b"[DONE]"]


def lmi_text(raw: bytes) -> str:
    return "".join(orjson.loads(line)["token"]["text"] for line in raw.splitlines())


def sagemaker_text(raw: bytes) -> str:
    buffer = EventStreamBuffer()
    buffer.add_data(raw)
    return "".join(lmi_text(message.payload) for message in buffer)


# protocol -> (path, body for a prompt, the streamed text from the raw body, the prompt's words)
Route = tuple[str, Callable[[str], dict], Callable[[bytes], str], Callable[[str], list[str]]]
ROUTES: dict[str, Route] = {
    "lmi": ("/invocations",
            lambda p: {"inputs": p, "parameters": {"max_new_tokens": TOKENS}, "stream": True},
            lmi_text, str.split),
    "sagemaker": ("/endpoints/e/invocations-response-stream",
                  lambda p: {"inputs": p, "parameters": {"max_new_tokens": TOKENS},
                             "stream": True},
                  sagemaker_text, str.split),
    "openai-chat": ("/v1/chat/completions",
                    lambda p: {"messages": [{"role": "user", "content": p}],
                               "max_tokens": TOKENS, "stream": True},
                    lambda raw: "".join(c["choices"][0]["delta"].get("content") or ""
                                        for c in sse_data(raw) if c["choices"]),
                    lambda p: ["<|user|>", *p.split(), "<|assistant|>"]),
    "openai-completions": ("/v1/completions",
                           lambda p: {"prompt": p, "max_tokens": TOKENS, "stream": True},
                           lambda raw: "".join(c["choices"][0]["text"] for c in sse_data(raw)),
                           str.split),
    "tgi": ("/generate_stream",
            lambda p: {"inputs": p, "parameters": {"max_new_tokens": TOKENS}},
            lambda raw: "".join(e["token"]["text"] for e in sse_data(raw)), str.split),
    "triton": ("/v2/models/fake-model/generate_stream",
               lambda p: {"text_input": p, "parameters": {"max_new_tokens": TOKENS}},
               lambda raw: "".join(e["text_output"] for e in sse_data(raw)), str.split),
}


def echo(words: list[str]) -> str:
    """What the FakeEngine answers: the prompt's words, cycling, one per token."""
    return "".join(f" {words[i % len(words)]}" for i in range(TOKENS))


async def test_500_concurrent_streams_over_every_protocol_are_each_whole_and_their_own():
    engine = FakeEngine(token_delay=0.001)  # tokens interleave across the streams
    names = sorted(ROUTES)
    with serving(served_app(engine)) as url:
        limits = httpx.Limits(max_connections=STREAMS)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:

            async def one(i: int) -> tuple[str, str, str]:
                path, body, text, words = ROUTES[names[i % len(names)]]
                prompt = f"s{i}a s{i}b s{i}c"
                response = await http.post(path, json=body(prompt))
                assert response.status_code == 200, response.text
                return names[i % len(names)], text(response.content), echo(words(prompt))

            results = await asyncio.gather(*(one(i) for i in range(STREAMS)))
    wrong = [(name, got, want) for name, got, want in results if got != want]
    assert not wrong, wrong[:5]
    assert len(engine.requests) == STREAMS and not engine.aborted


QUESTIONS = [f"Count from {i} to {i + 5}, then name a color." for i in range(32)]


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def greedy_url(request, served, tmp_path_factory) -> Iterator[str]:
    """The shared server (float32), and one serving bf16 where this CPU has bf16 kernels: there
    too a greedy answer may not depend on what else is in the batch. Both on float linears; the
    quantized default's first burst is test_a_quantized_servers_first_burst_is_every_later_ones
    and its batch invariance tests/engines/test_quantized_engine.py."""
    if request.param == "fp32":
        yield served.url
        return
    if not has_native_bf16():
        pytest.skip("this CPU has no bf16 matmul kernels (AVX512-BF16 or AMX): oneDNN widens "
                    "bf16 by the batch's shape there, and auto serves float32")
    log = tmp_path_factory.mktemp("bf16") / "server.log"
    with running_server("option.dtype=bf16", "option.quantize=none",
                        "option.embedding_model_id=none", log_path=log) as url:
        yield url


@pytest.mark.e2e
async def test_32_concurrent_greedy_streams_equal_the_answers_without_streaming(greedy_url):
    params = {"max_new_tokens": 24, "do_sample": False}
    async with httpx.AsyncClient(base_url=greedy_url, timeout=600) as http:

        async def whole(question: str) -> str:
            response = await http.post("/invocations", json={"inputs": chat(question),
                                                              "parameters": params})
            return response.json()["generated_text"]

        async def streamed(question: str) -> str:
            response = await http.post("/invocations", json={
                "inputs": chat(question), "parameters": params, "stream": True})
            return lmi_text(response.content)

        answers = await asyncio.gather(*(whole(q) for q in QUESTIONS))
        streams = await asyncio.gather(*(streamed(q) for q in QUESTIONS))
    assert streams == answers
    assert len(set(answers)) > 1 and all(answers)


@pytest.mark.e2e
def test_a_quantized_servers_first_burst_is_every_later_ones(tmp_path):
    """The default's GGUF blocks, a fresh server, 32 greedy requests at once and again twice:
    each token's logprob (the first one's from the first prefill) the same bits every time.
    MKL's vector math, first used by that prefill from two threads at once, had rotated half its
    rows with an inaccurate cos in about half the starts (machine.settle_vector_math). Eager
    steps: no graph compiles beside the other tests (test_decode_graphs.py checks that a
    compiled step gives the eager one's bits)."""
    body = {"max_tokens": 8, "temperature": 0, "logprobs": 1}
    with running_server("option.quantize=gguf", "option.enforce_eager=true",
                        "option.embedding_model_id=none",
                        log_path=tmp_path / "server.log") as url:

        async def burst() -> list[tuple[str, list[float]]]:
            async with httpx.AsyncClient(base_url=url, timeout=600) as http:
                replies = await asyncio.gather(*(
                    http.post("/v1/completions", json={**body, "prompt": chat(q)})
                    for q in QUESTIONS))
            choices = [reply.json()["choices"][0] for reply in replies]
            return [(c["text"], c["logprobs"]["token_logprobs"]) for c in choices]

        first, *later = (asyncio.run(burst()) for _ in range(3))
    assert all(answers == first for answers in later)
    assert len({text for text, _ in first}) > 1
