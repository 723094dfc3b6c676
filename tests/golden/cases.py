"""Recorded wire responses of every HTTP route, on the FakeEngine: the server's byte-level
contract. `record.py` writes `responses.json`; `tests/protocols/test_golden_responses.py` replays
the same cases and compares. What varies between runs (ids, `created`, timings) is normalized away;
everything else, status, content type and body bytes, must match exactly.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from botocore.eventstream import EventStreamBuffer
from fakes import FakeEmbeddingEngine, FakeEngine, served_app

GOLDEN_FILE = "responses.json"


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    body: Any = None  # JSON-encoded; bytes are sent as they are
    headers: dict[str, str] = field(default_factory=dict)


CHAT = [{"role": "user", "content": "a b c"}]
LMI_STREAM = {"inputs": "a b c", "parameters": {"max_new_tokens": 3}, "stream": True}


def _lmi_cases() -> list[Case]:
    post = "POST"
    return [
        Case("ping", "GET", "/ping"),
        Case("lmi-plain", post, "/invocations", {"inputs": "a b c"}),
        Case("lmi-details", post, "/invocations", {"inputs": "a b c", "parameters": {
            "max_new_tokens": 3, "details": True, "decoder_input_details": True,
            "top_n_tokens": 2}}),
        Case("lmi-best-of", post, "/invocations", {"inputs": "a b c", "parameters": {
            "max_new_tokens": 2, "n": 2, "best_of": 3, "details": True}}),
        Case("lmi-full-text", post, "/invocations", {"inputs": "a b", "parameters": {
            "max_new_tokens": 2, "return_full_text": True}}),
        Case("lmi-eos", post, "/invocations", {"inputs": "a b [[eos:1]]", "parameters": {
            "details": True}}),
        Case("lmi-stream", post, "/invocations", LMI_STREAM),
        Case("lmi-stream-details", post, "/invocations", {**LMI_STREAM, "parameters": {
            "max_new_tokens": 3, "details": True, "top_n_tokens": 2}}),
        Case("lmi-stream-eos", post, "/invocations", {**LMI_STREAM, "inputs": "a [[eos:2]]"}),
        Case("lmi-stream-error", post, "/invocations", {**LMI_STREAM, "inputs": "a [[error:2]]"}),
        Case("lmi-stream-error-first", post, "/invocations",
             {**LMI_STREAM, "inputs": "a [[error:0]]"}),
        Case("lmi-stream-raise", post, "/invocations", {**LMI_STREAM, "inputs": "a [[raise:2]]"}),
        Case("lmi-stream-n", post, "/invocations", {**LMI_STREAM, "parameters": {"n": 2}}),
        Case("lmi-error", post, "/invocations", {"inputs": "a [[error:1]]"}),
        Case("lmi-raise", post, "/invocations", {"inputs": "a [[raise:1]]"}),
        Case("lmi-invalid-marker", post, "/invocations", {"inputs": "a [[invalid]]"}),
        Case("lmi-bad-top-p", post, "/invocations", {"inputs": "a", "parameters": {"top_p": 1.5}}),
        Case("lmi-no-inputs", post, "/invocations", {"parameters": {}}),
        Case("lmi-not-object", post, "/invocations", [1, 2]),
        Case("lmi-bad-json", post, "/invocations", b"{not json"),
        Case("lmi-too-long", post, "/invocations", {"inputs": "w " * 80}),
        Case("lmi-beams", post, "/invocations", {"inputs": "a", "parameters": {"num_beams": 2}}),
        Case("predictions", post, "/predictions/fake-model", {"inputs": "a b"}),
        Case("predictions-other", post, "/predictions/other", {"inputs": "a b"}),
        Case("metrics", "GET", "/metrics"),
    ]


def _openai_cases() -> list[Case]:
    post = "POST"
    chat = "/v1/chat/completions"
    done = "/v1/completions"
    return [
        Case("models", "GET", "/v1/models"),
        Case("chat", post, chat, {"messages": CHAT, "max_tokens": 3}),
        Case("chat-model", post, chat, {"model": "fake-model", "messages": CHAT, "max_tokens": 2,
                                        "n": 2, "logprobs": True, "top_logprobs": 2}),
        Case("chat-stream", post, chat, {"messages": CHAT, "max_tokens": 3, "stream": True,
                                         "stream_options": {"include_usage": True}}),
        Case("chat-stream-plain", post, chat, {"messages": CHAT, "max_tokens": 2,
                                               "stream": True}),
        Case("chat-stream-error", post, chat, {"messages": [{"role": "user",
                                               "content": "a [[error:2]]"}], "stream": True}),
        Case("chat-stream-raise-first", post, chat, {"messages": [{"role": "user",
                                                     "content": "a [[raise:0]]"}],
                                                     "stream": True}),
        Case("chat-error", post, chat, {"messages": [{"role": "user",
                                        "content": "a [[error:2]]"}]}),
        Case("chat-tools", post, chat, {"messages": CHAT, "max_tokens": 3, "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}),
        Case("chat-other-model", post, chat, {"model": "x", "messages": CHAT}),
        Case("chat-bad-role", post, chat, {"messages": [{"role": "robot", "content": "a"}]}),
        Case("chat-bad-temperature", post, chat, {"messages": CHAT, "temperature": 3}),
        Case("chat-late-system", post, chat, {"messages": [
            *CHAT, {"role": "system", "content": "b"}]}),
        Case("chat-image", post, chat, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}),
        Case("chat-too-many-tokens", post, chat, {"messages": CHAT, "max_tokens": 500}),
        Case("chat-invalid-marker", post, chat, {"messages": [{"role": "user",
                                                 "content": "[[invalid]]"}]}),
        Case("chat-bad-json", post, chat, b"[1,"),
        Case("chat-echo", post, chat, {"messages": [*CHAT, {"role": "assistant",
                                       "content": "x y"}], "continue_final_message": True,
                                       "echo": True, "max_tokens": 2}),
        Case("completion", post, done, {"prompt": "a b c", "max_tokens": 3}),
        Case("completion-list", post, done, {"prompt": ["a b", "c d"], "max_tokens": 2, "n": 2}),
        Case("completion-ids", post, done, {"prompt": [11, 12], "max_tokens": 2}),
        Case("completion-echo", post, done, {"prompt": "a b", "max_tokens": 2, "echo": True,
                                             "logprobs": 1}),
        Case("completion-best-of", post, done, {"prompt": "a b", "max_tokens": 2, "best_of": 3,
                                                "n": 2}),
        Case("completion-stream", post, done, {"prompt": ["a b", "c"], "max_tokens": 2,
                                               "stream": True, "logprobs": 1}),
        Case("completion-suffix", post, done, {"prompt": "a", "suffix": "b"}),
        Case("completion-bad-ids", post, done, {"prompt": [[-1]]}),
        Case("invocations-chat", post, "/invocations", {"messages": CHAT, "max_tokens": 2}),
        Case("invocations-chat-stream", post, "/invocations",
             {"messages": CHAT, "max_tokens": 2, "stream": True}),
        Case("invocations-completion", post, "/invocations", {"prompt": "a b", "max_tokens": 2}),
        Case("invocations-completion-bad", post, "/invocations", {"prompt": "a", "n": 0}),
    ]


def _embedding_cases() -> list[Case]:
    post = "POST"
    db = "/serving-endpoints/{}/invocations"
    return [
        Case("embeddings", post, "/v1/embeddings", {"input": ["a b", "c"]}),
        Case("embeddings-base64", post, "/v1/embeddings", {"input": "a",
                                                           "encoding_format": "base64"}),
        Case("embeddings-dimensions", post, "/v1/embeddings", {"input": "a", "dimensions": 3}),
        Case("embeddings-other-model", post, "/v1/embeddings", {"input": "a", "model": "x"}),
        Case("embeddings-ids", post, "/v1/embeddings", {"input": [1, 2]}),
        Case("embeddings-empty", post, "/v1/embeddings", {"input": []}),
        Case("invocations-input", post, "/invocations", {"input": "a b"}),
        Case("databricks-chat", post, db.format("fake-model"), {"messages": CHAT,
                                                                "max_tokens": 2}),
        Case("databricks-chat-stream", post, db.format("fake-model"),
             {"messages": CHAT, "max_tokens": 2, "stream": True}),
        Case("databricks-completions", post, db.format("fake-model"),
             {"prompt": ["a", "b c"], "max_tokens": 2, "echo": True}),
        Case("databricks-truncate", post, db.format("fake-model"),
             {"prompt": "w " * 80, "max_tokens": 4, "error_behavior": "truncate"}),
        Case("databricks-embeddings", post, db.format("fake-embedder"),
             {"input": ["a"], "instruction": "q: "}),
        Case("databricks-wrong-task", post, db.format("fake-embedder"), {"messages": CHAT}),
        Case("databricks-wrong-task-llm", post, db.format("fake-model"), {"input": "a"}),
        Case("databricks-no-task", post, db.format("fake-model"), {"foo": 1}),
        Case("databricks-unknown", post, db.format("nope"), {"messages": CHAT}),
        Case("models-with-embedder", "GET", "/v1/models"),
    ]


def _sagemaker_cases() -> list[Case]:
    post = "POST"
    attrs = {"X-Amzn-SageMaker-Custom-Attributes": "trace=1"}
    return [
        Case("sm-invoke", post, "/endpoints/e/invocations", {"inputs": "a b"}, attrs),
        Case("sm-invoke-error", post, "/endpoints/e/invocations", {"inputs": "a [[invalid]]"},
             attrs),
        Case("sm-invoke-chat", post, "/endpoints/e/invocations", {"messages": CHAT,
                                                                  "max_tokens": 2}),
        Case("sm-stream", post, "/endpoints/e/invocations-response-stream", LMI_STREAM, attrs),
        Case("sm-stream-error", post, "/endpoints/e/invocations-response-stream",
             {**LMI_STREAM, "inputs": "a [[error:2]]"}),
        Case("sm-stream-refused", post, "/endpoints/e/invocations-response-stream",
             {**LMI_STREAM, "inputs": "a [[invalid]]"}),
        Case("sm-stream-chat", post, "/endpoints/e/invocations-response-stream",
             {"messages": CHAT, "max_tokens": 2, "stream": True},
             {"X-Amzn-SageMaker-Accept": "text/event-stream"}),
    ]


def _dynamic_cases() -> list[Case]:
    post = "POST"
    return [
        Case("dyn-single", post, "/invocations", {"inputs": "a b", "parameters": {
            "max_new_tokens": 2}}),
        Case("dyn-list", post, "/invocations", {"inputs": ["a b", "c"], "parameters": {
            "max_new_tokens": 2, "return_full_text": True}}),
        Case("dyn-invalid", post, "/invocations", {"inputs": ["a", "b [[invalid]]"]}),
        Case("dyn-error", post, "/invocations", {"inputs": ["a", "b [[error:1]]"]}),
        Case("dyn-n", post, "/invocations", {"inputs": "a", "parameters": {"n": 2}}),
        Case("dyn-empty", post, "/invocations", {"inputs": []}),
        Case("dyn-chat", post, "/invocations", {"messages": CHAT, "max_tokens": 2}),
        Case("dyn-metrics", "GET", "/metrics"),
    ]


def _dynamic_stream_cases() -> list[Case]:
    post = "POST"
    return [
        Case("dyns-list", post, "/invocations", {"inputs": ["a b", "c"], "parameters": {
            "max_new_tokens": 2}}),
        Case("dyns-error-later", post, "/invocations", {"inputs": ["a b c", "d [[error:1]]"]}),
        Case("dyns-error-first", post, "/invocations", {"inputs": "d [[error:0]]"}),
        Case("dyns-raise", post, "/invocations", {"inputs": "d e [[raise:1]]"}),
        Case("dyns-sagemaker", post, "/endpoints/e/invocations-response-stream",
             {"inputs": ["a b", "c [[error:1]]"]}),
    ]


def _loading_cases() -> list[Case]:
    post = "POST"
    return [
        Case("loading-ping", "GET", "/ping"),
        Case("loading-lmi", post, "/invocations", {"inputs": "a"}),
        Case("loading-chat", post, "/v1/chat/completions", {"messages": CHAT}),
        Case("loading-invocations-chat", post, "/invocations", {"messages": CHAT}),
        Case("loading-completion", post, "/v1/completions", {"prompt": "a"}),
        Case("loading-embeddings", post, "/v1/embeddings", {"input": "a"}),
        Case("loading-metrics", "GET", "/metrics"),
    ]


def _embeddings_only_cases() -> list[Case]:
    post = "POST"
    return [
        Case("eo-models", "GET", "/v1/models"),
        Case("eo-embeddings", post, "/v1/embeddings", {"input": "a"}),
        Case("eo-invocations", post, "/invocations", {"input": ["a", "b"]}),
        Case("eo-lmi", post, "/invocations", {"inputs": "a"}),
        Case("eo-chat", post, "/v1/chat/completions", {"messages": CHAT}),
        Case("eo-completion", post, "/v1/completions", {"prompt": "a"}),
        Case("eo-databricks", post, "/serving-endpoints/fake-embedder/invocations",
             {"input": "a"}),
        Case("eo-databricks-chat", post, "/serving-endpoints/fake-embedder/invocations",
             {"messages": CHAT}),
    ]


def _kserve_cases() -> list[Case]:
    post = "POST"
    infer = "/v2/models/fake-model/infer"
    tensor = {"name": "text_input", "shape": [2], "datatype": "BYTES", "data": ["a b", "c"]}
    header = orjson.dumps({"inputs": [{**tensor, "data": None, "shape": [1],
                                       "parameters": {"binary_data_size": 7}}],
                           "parameters": {"binary_data_output": True, "max_new_tokens": 2}})
    binary = b"\x03\x00\x00\x00a b"
    return [
        Case("v2-server", "GET", "/v2"),
        Case("v2-live", "GET", "/v2/health/live"),
        Case("v2-ready", "GET", "/v2/health/ready"),
        Case("v2-model", "GET", "/v2/models/fake-model"),
        Case("v2-model-version", "GET", "/v2/models/fake-model/versions/1/ready"),
        Case("v2-model-other", "GET", "/v2/models/other"),
        Case("v2-infer", post, infer, {"id": "7", "inputs": [tensor],
                                       "parameters": {"max_new_tokens": 2}}),
        Case("v2-infer-binary", post, infer, header + binary,
             {"Inference-Header-Content-Length": str(len(header))}),
        Case("v2-infer-bad-type", post, infer, {"inputs": [{**tensor, "datatype": "FP32"}]}),
        Case("v2-infer-bad-json", post, infer, b"{"),
        Case("v1-model", "GET", "/v1/models/fake-model"),
        Case("v1-predict", post, "/v1/models/fake-model:predict", {"instances": [
            "a b", {"text": "c", "max_new_tokens": 2}]}),
        Case("v1-predict-embedder", post, "/v1/models/fake-embedder:predict",
             {"instances": ["a b"]}),
        Case("v1-explain", post, "/v1/models/fake-model:explain", {"instances": ["a"]}),
        Case("v1-predict-bad", post, "/v1/models/fake-model:predict", {"instances": [3]}),
    ]


def _generate_and_tgi_cases() -> list[Case]:
    post = "POST"
    generate = {"id": "g1", "text_input": "a b", "parameters": {"max_new_tokens": 2,
                                                                 "details": True}}
    tgi = {"inputs": "a b", "parameters": {"max_new_tokens": 2, "details": True,
                                           "decoder_input_details": True}}
    return [
        Case("generate", post, "/v2/models/fake-model/generate", generate),
        Case("generate-stream", post, "/v2/models/fake-model/generate_stream", generate),
        Case("generate-bad", post, "/v2/models/fake-model/generate", {"text_input": "a",
                                                                      "parameters": {"seed": 0}}),
        Case("tgi-generate", post, "/generate", tgi),
        Case("tgi-generate-stream", post, "/generate_stream", {"inputs": "a b", "parameters": {
            "max_new_tokens": 2, "details": True}}),
        Case("tgi-compat", post, "/", {"inputs": "a", "parameters": {"max_new_tokens": 1}}),
        Case("tgi-bad", post, "/generate", {"inputs": "a", "parameters": {"top_p": 1.0}}),
        Case("tgi-stream-bad", post, "/generate_stream", {"inputs": "a", "parameters": {
            "best_of": 2, "do_sample": True}}),
        Case("tgi-health", "GET", "/health"),
    ]


# (group name, server settings, whether the engines are loaded, cases)
GROUPS: list[tuple[str, dict[str, Any], bool, list[Case]]] = [
    ("lmi", {}, True, _lmi_cases()),
    ("sse", {"output_formatter": "sse"}, True, [
        Case("sse-stream", "POST", "/invocations", {**LMI_STREAM, "parameters": {
            "details": True, "max_new_tokens": 3}}),
        Case("sse-stream-error", "POST", "/invocations", {**LMI_STREAM,
                                                           "inputs": "a [[error:1]]"})]),
    ("json", {"output_formatter": "json"}, True, [
        Case("json-stream", "POST", "/invocations", LMI_STREAM)]),
    ("tgi", {"tgi_compat": True}, True, [
        Case("tgi-plain", "POST", "/invocations", {"inputs": "a b", "parameters": {
            "max_new_tokens": 2}}),
        Case("tgi-stream", "POST", "/invocations", {**LMI_STREAM, "parameters": {
            "top_n_tokens": 2, "max_new_tokens": 2}}),
        Case("tgi-stream-error", "POST", "/invocations", {**LMI_STREAM,
                                                           "inputs": "a [[error:1]]"})]),
    ("small-body", {"max_request_size": 64}, True, [
        Case("too-large-lmi", "POST", "/invocations", {"inputs": "a " * 64}),
        Case("too-large-chat", "POST", "/v1/chat/completions", {"messages": [
            {"role": "user", "content": "a " * 64}]})]),
    ("openai", {}, True, _openai_cases()),
    ("full-text", {"full_text_enabled": True}, True, [
        Case("full-text-stream", "POST", "/v1/chat/completions",
             {"messages": CHAT, "max_tokens": 3, "stream": True})]),
    ("no-embedder", {"embedder": False}, True, [
        Case("no-embedder", "POST", "/v1/embeddings", {"input": "a"}),
        Case("no-embedder-invocations", "POST", "/invocations", {"input": "a"})]),
    ("embeddings", {}, True, _embedding_cases()),
    ("sagemaker", {}, True, _sagemaker_cases()),
    ("dynamic", {"dynamic": (2, 5, False)}, True, _dynamic_cases()),
    ("dynamic-stream", {"dynamic": (2, 5, True)}, True, _dynamic_stream_cases()),
    ("loading", {}, False, _loading_cases()),
    ("embeddings-only", {"embeddings_only": True}, True, _embeddings_only_cases()),
    ("kserve", {}, True, _kserve_cases()),
    ("generate-and-tgi", {}, True, _generate_and_tgi_cases()),
]

_ID = re.compile(rb"[0-9a-f]{32}")
_TIMES = re.compile(rb'"(created|created_at|completed_at|prefill_time|decode_time|'
                    rb'queue_wait_time|seed)":[0-9.e-]+')
_DECODE_TIMES = re.compile(rb'"decode_time_arr":\[[0-9.e,-]*\]')
# /metrics: when series were created, and latencies (their sums and which bucket they fell in)
_METRIC_TIMES = re.compile(rb"^(\S+(?:_created|_seconds_bucket|_seconds_sum)(?:\{.*\})?) \S+$",
                           re.MULTILINE)


def normalize(body: bytes) -> str:
    body = _ID.sub(b"<id>", body)
    body = _TIMES.sub(rb'"\1":0', body)
    body = _METRIC_TIMES.sub(rb"\1 0", body)
    return _DECODE_TIMES.sub(b'"decode_time_arr":[]', body).decode("utf-8", "replace")


def _event_stream(raw: bytes) -> list[dict[str, Any]]:
    buffer = EventStreamBuffer()
    buffer.add_data(raw)
    return [{"headers": dict(m.headers), "payload": normalize(m.payload)} for m in buffer]


def _answer(response: httpx.Response) -> dict[str, Any]:
    kept = ("content-type", "x-amzn-errortype", "x-amzn-sagemaker-custom-attributes",
            "x-amzn-sagemaker-content-type", "retry-after", "inference-header-content-length")
    headers = {k: response.headers[k] for k in kept if k in response.headers}
    answer: dict[str, Any] = {"status": response.status_code, "headers": headers}
    if headers.get("content-type") == "application/vnd.amazon.eventstream":
        answer["events"] = _event_stream(response.content)
    else:
        answer["body"] = normalize(response.content)
    return answer


async def _run_group(settings: dict[str, Any], loaded: bool, cases: list[Case]
                     ) -> dict[str, Any]:
    engine = FakeEngine(lora=False)  # as recorded: no adapters, so no LoRA series in /metrics
    embedder = FakeEmbeddingEngine() if settings.pop("embedder", True) else None
    app = served_app(engine, embedder, loaded=loaded, **settings)
    transport = httpx.ASGITransport(app=app)
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(transport=transport, base_url="http://golden") as client:
        for case in cases:
            content = case.body if isinstance(case.body, bytes) else (
                None if case.body is None else orjson.dumps(case.body))
            headers = {"content-type": "application/json", **case.headers}
            response = await client.request(case.method, case.path, content=content,
                                            headers=headers)
            out[case.name] = _answer(response)
    return out


def record_all() -> dict[str, Any]:
    """Every case's normalized answer, by case name."""
    answers: dict[str, Any] = {}
    for _group, settings, loaded, cases in GROUPS:
        answers |= asyncio.run(_run_group(dict(settings), loaded, cases))
    return answers
