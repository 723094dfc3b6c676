"""End to end: dynamic batching (`option.rolling_batch=disable`) on the embedded SmolLM2."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import pytest
import requests
from server_process import running_server

pytestmark = pytest.mark.e2e

# A batch closes only once 4 requests are queued (the delay is out of reach): how many batches
# run does not depend on how fast the requests arrive.
BATCHING = ("option.rolling_batch=disable", "batch_size=4", "max_batch_delay=600000")
QUICK = ("option.rolling_batch=disable", "batch_size=4", "max_batch_delay=100")  # no counts
FRANCE = "What is the capital of France?"
SUM = "What is 2 + 2?"
COLORS = "Name three colors."


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def body(question: str | list[str], max_new_tokens: int = 8, **parameters) -> dict:
    inputs = [chat(q) for q in question] if isinstance(question, list) else chat(question)
    return {"inputs": inputs, "parameters": {"max_new_tokens": max_new_tokens, **parameters}}


def invoke(url: str, payload: dict, **kwargs) -> requests.Response:
    return requests.post(f"{url}/invocations", data=orjson.dumps(payload), timeout=120, **kwargs)


def together(url: str, payloads: list[dict]) -> list[requests.Response]:
    with ThreadPoolExecutor(len(payloads)) as pool:
        return list(pool.map(lambda p: invoke(url, p), payloads))


def batch_stats(url: str) -> tuple[float, float]:
    """(batches run, requests they served), from the lmi_dynamic_batch_size summary."""
    found = {}
    for line in requests.get(f"{url}/metrics", timeout=5).text.splitlines():
        if match := re.match(r"lmi_dynamic_batch_size_(count|sum)\{.*\} (\S+)", line):
            found[match[1]] = float(match[2])
    return found["count"], found["sum"]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with running_server(*BATCHING, log_path=log) as url:
        yield url, log


def test_eight_requests_run_as_two_batches_each_with_its_own_parameters(server):
    url, log = server
    before = batch_stats(url)
    sampled = {"do_sample": True, "temperature": 0.9, "seed": 7}
    payloads = [
        body(FRANCE), body(SUM), body(FRANCE, 3), body(COLORS, **sampled),
        body(COLORS, **sampled), body([SUM, FRANCE, COLORS]), body("Say hello."),
        body("Give me a fruit name."),
    ]
    responses = together(url, payloads)
    assert [r.status_code for r in responses] == [200] * 8
    answers = [[a["generated_text"] for a in r.json()] for r in responses]
    assert [len(a) for a in answers] == [1, 1, 1, 1, 1, 3, 1, 1]
    texts = [a[0] for a in answers]
    assert "Paris" in texts[0] and "4" in texts[1]
    assert texts[0].startswith(texts[2]) and len(texts[2]) < len(texts[0])  # max_new_tokens
    assert texts[3] == texts[4]  # the same seed samples the same text
    listed = answers[5]  # a list input is one request, answered in input order
    assert "4" in listed[0] and "Paris" in listed[1] and "Red" in listed[2]
    after = batch_stats(url)
    assert (after[0] - before[0], after[1] - before[1]) == (2, 8)
    logged = re.findall(r"dynamic batch \d+: (\d+) requests", log.read_text())
    assert logged[-2:] == ["4", "4"]


def test_a_bad_request_gets_424_while_the_others_of_its_batch_succeed(server):
    url, _ = server
    before = batch_stats(url)
    too_long = {"inputs": "hello " * 9000, "parameters": {"max_new_tokens": 4}}
    responses = together(url, [body(FRANCE, 4), too_long, body(SUM, 4), body(COLORS, 4),
                               body("Say hello.", 4)])
    assert [r.status_code for r in responses] == [200, 424, 200, 200, 200]
    error = responses[1].json()
    assert (error["code"], error["message"]) == (424, "invoke handler failure")
    assert "inputs" in error["error"]
    after = batch_stats(url)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 4)  # the bad one never joined


def test_enable_streaming_streams_outputs_lines_with_the_same_text(tmp_path):
    payload = body([FRANCE, SUM])
    with running_server(*QUICK, log_path=tmp_path / "plain.log") as url:
        plain = [a["generated_text"] for a in invoke(url, payload).json()]
    with running_server(*QUICK, "option.enable_streaming=true",
                        log_path=tmp_path / "server.log") as streaming_url:
        response = invoke(streaming_url, payload, stream=True)
        assert response.headers["content-type"].startswith("application/jsonlines")
        outputs = [orjson.loads(line)["outputs"] for line in response.iter_lines() if line]
    assert len(outputs) > 1 and all(len(texts) == 2 for texts in outputs)
    # The whole answer leads with the prompt (DJL's decodes the whole sequence); the stream
    # carries the generation (DJL's streamer yields new tokens).
    streamed = ["".join(column) for column in zip(*outputs, strict=True)]
    prompts = payload["inputs"]
    assert [prompt + text for prompt, text in zip(prompts, streamed, strict=True)] == plain
