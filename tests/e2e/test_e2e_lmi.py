"""End to end: the real embedded SmolLM2 behind `lmi-serve`, driven over HTTP as a user would."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from server_process import running_server

pytestmark = pytest.mark.e2e

QUESTIONS = [
    "What is deep learning?",
    "Name three colors.",
    "Why is the sky blue?",
    "Write one sentence about cats.",
    "What is 2 + 2?",
    "Say hello in Chinese.",
    "Give me a fruit name.",
    "What is the capital of France?",
]


def chat(question: str) -> str:
    return (f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with running_server(log_path=log) as server_url:
        yield server_url


def invoke(url: str, body: dict, **kwargs) -> requests.Response:
    return requests.post(f"{url}/invocations", data=orjson.dumps(body), timeout=120, **kwargs)


def stream_lines(url: str, body: dict) -> tuple[requests.Response, list[dict]]:
    response = invoke(url, {**body, "stream": True}, stream=True)
    lines = [orjson.loads(line) for line in response.iter_lines() if line]
    return response, lines


def test_ping_and_json_with_details(url):
    assert requests.get(f"{url}/ping", timeout=5).json() == {"status": "Healthy"}
    response = invoke(url, {"inputs": chat(QUESTIONS[0]),
                            "parameters": {"max_new_tokens": 12, "details": True}})
    assert response.status_code == 200
    body = response.json()
    details = body["details"]
    assert details["finish_reason"] in ("length", "eos_token")
    assert details["generated_tokens"] == len(details["tokens"]) <= 12
    assert "".join(t["text"] for t in details["tokens"]) == body["generated_text"]
    assert "learning" in body["generated_text"].lower()
    assert all(t["log_prob"] <= 0 for t in details["tokens"])


def test_jsonlines_stream_matches_the_plain_answer(url):
    body = {"inputs": chat(QUESTIONS[2]), "parameters": {"max_new_tokens": 16}}
    plain = invoke(url, body).json()["generated_text"]
    response, lines = stream_lines(url, body)
    assert response.headers["content-type"].startswith("application/jsonlines")
    assert all("token" in line for line in lines)
    assert "".join(line["token"]["text"] for line in lines) == plain
    assert lines[-1]["generated_text"] == plain
    assert all("generated_text" not in line for line in lines[:-1])


def test_bad_input_gets_424_naming_the_field_and_the_server_keeps_serving(url):
    cases = [
        (b'{"inputs": "hi", ', "json"),
        (orjson.dumps({"parameters": {}}), "inputs"),
        (orjson.dumps({"inputs": "hi", "parameters": {"max_new_tokens": -1}}), "max_new_tokens"),
        (orjson.dumps({"inputs": "hi", "parameters": {"temperature": "abc"}}), "temperature"),
        (orjson.dumps({"inputs": "hello " * 9000}), "inputs"),
    ]
    for raw, field in cases:
        response = requests.post(f"{url}/invocations", data=raw, timeout=30)
        assert response.status_code == 424, raw[:60]
        assert response.json()["code"] == 424
        assert field in response.json()["error"].lower()
    ok = invoke(url, {"inputs": chat(QUESTIONS[4]), "parameters": {"max_new_tokens": 4}})
    assert ok.status_code == 200 and ok.json()["generated_text"]


def test_concurrent_streams_give_each_the_text_it_gets_alone(url):
    bodies = [{"inputs": chat(q), "parameters": {"max_new_tokens": 20}} for q in QUESTIONS]
    alone = [invoke(url, b).json()["generated_text"] for b in bodies[:3]]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda b: stream_lines(url, b)[1][-1]["generated_text"], bodies))
    assert together[:3] == alone


def test_seeded_sampling_is_reproducible_under_load(url):
    body = {"inputs": chat(QUESTIONS[3]),
            "parameters": {"do_sample": True, "temperature": 0.9, "seed": 1234,
                           "max_new_tokens": 16}}
    first = invoke(url, body).json()["generated_text"]
    with ThreadPoolExecutor(3) as pool:
        noise = [pool.submit(invoke, url, {"inputs": chat(q), "parameters": {"max_new_tokens": 24}})
                 for q in QUESTIONS[:2]]
        second = pool.submit(invoke, url, body).result().json()["generated_text"]
        [n.result() for n in noise]
    assert first == second


def test_multibyte_text_streams_whole(url):
    _, lines = stream_lines(url, {"inputs": chat("请用中文介绍一下你自己。😀"),
                                  "parameters": {"max_new_tokens": 24}})
    texts = [line["token"]["text"] for line in lines]
    assert "\ufffd" not in "".join(texts)
    assert "".join(texts) == lines[-1]["generated_text"]


def metric(url: str, name: str) -> float:
    for line in requests.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_client_that_disconnects_frees_its_slot(url):
    body = {"inputs": chat(QUESTIONS[0]),
            "parameters": {"max_new_tokens": 2000, "ignore_eos_token": True}, "stream": True}
    generated = metric(url, "lmi_generated_tokens_total")
    response = invoke(url, body, stream=True)
    lines = response.iter_lines()
    next(lines), next(lines)
    assert metric(url, "lmi_running_requests") == 1
    response.close()
    guard = time.monotonic() + 120  # against a hang only: the verdict is the count below
    while metric(url, "lmi_running_requests"):  # another process: no event to wait on
        assert time.monotonic() < guard, "the slot was never freed"
        time.sleep(0.05)
    # The slot was freed by the hang-up, not by the request running its 2000 tokens.
    assert metric(url, "lmi_generated_tokens_total") - generated < 2000


def sse_events(response: requests.Response) -> list[dict]:
    return [orjson.loads(line.split(b":", 1)[1]) for line in response.iter_lines()
            if line.startswith(b"data:")]


@pytest.mark.parametrize(
    ("option", "content_type"),
    [("option.output_formatter=sse", "text/event-stream"),
     ("option.tgi_compat=true", "text/event-stream")],
)
def test_sse_and_tgi_compat_servers(tmp_path, option, content_type):
    with running_server(option, log_path=tmp_path / "server.log") as url:
        body = {"inputs": chat(QUESTIONS[6]), "parameters": {"max_new_tokens": 8}}
        plain = invoke(url, body)
        response = invoke(url, {**body, "stream": True}, stream=True)
        assert response.headers["content-type"].startswith(content_type)
        events = sse_events(response)
    if "tgi_compat" in option:
        assert isinstance(plain.json(), list) and plain.json()[0]["generated_text"]
        text = plain.json()[0]["generated_text"]
    else:  # a configured formatter answers every request, `stream: false` too (DJL's rule)
        assert plain.headers["content-type"].startswith(content_type)
        text = sse_events(plain)[-1]["generated_text"]
    assert "".join(e["token"]["text"] for e in events) == text
    assert events[-1]["generated_text"] == text


def test_metrics_carry_what_the_inference_gateway_reads(served):
    """The Gateway API Inference Extension's model-server protocol (what llm-d's endpoint picker
    scrapes), on whichever engine serves: queued and running requests and the KV cache's use
    as gauges under vLLM's names and labels, and `vllm:cache_config_info` with the block size
    and block count its prefix-aware routing sizes its index by."""
    families = {family.name: family for family in
                text_string_to_metric_families(requests.get(f"{served.url}/metrics").text)}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc"):
        family = families[name]
        assert family.type == "gauge"
        [sample] = family.samples
        assert sample.labels == {"model_name": "smollm2-135m-instruct", "engine": "0"}
        assert sample.value >= 0
    assert families["vllm:kv_cache_usage_perc"].samples[0].value <= 1
    [config] = families["vllm:cache_config_info"].samples
    assert config.value == 1
    assert int(config.labels["block_size"]) > 0 and int(config.labels["num_gpu_blocks"]) > 0
