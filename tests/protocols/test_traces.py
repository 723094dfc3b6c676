"""OpenTelemetry traces, as an operator following a request across services sees them: a local
OTLP receiver (gRPC, and HTTP/protobuf) gets one `llm_request` span per request, in the trace
the caller's `traceparent` named, with vLLM's `gen_ai.*` attributes equal to the answer's usage,
and its admission, prefill and stream as child spans; the request's log lines carry the trace
id. With no endpoint configured nothing of OpenTelemetry is even imported."""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import openai
import pytest
import requests
import tritonclient.grpc as triton
from fakes import FakeEngine, served_app
from otlp_receiver import Receiver, grpc_receiver, http_receiver
from server_process import free_port, serving

from handlers.config import ConfigError, load_config, parse_args

MODEL = "fake-model"
CHILDREN = ("admission", "prefill", "stream")


@pytest.fixture(scope="module", autouse=True)
def prompt_export() -> Iterator[None]:
    """Export each batch of spans 50 ms after its first span (the SDK's default waits 5 s)."""
    before = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "50"
    yield
    if before is None:
        del os.environ["OTEL_BSP_SCHEDULE_DELAY"]
    else:
        os.environ["OTEL_BSP_SCHEDULE_DELAY"] = before


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with grpc_receiver() as received:
        yield received


@pytest.fixture(scope="module")
def traced(receiver: Receiver) -> Iterator[tuple[str, str]]:
    """A server exporting to the gRPC receiver: (its URL, its gRPC address)."""
    port = free_port()
    app = served_app(FakeEngine(), otlp_traces_endpoint=receiver.endpoint,
                     grpc_host="127.0.0.1", grpc_port=port)
    with serving(app) as base:
        yield base, f"127.0.0.1:{port}"


def parent() -> tuple[str, str, str]:
    """A caller's trace id, span id and the traceparent header naming them."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def test_a_chat_completion_is_a_span_in_the_callers_trace(traced, receiver):
    trace_id, span_id, header = parent()
    client = openai.OpenAI(base_url=f"{traced[0]}/v1", api_key="none")
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a b c"}], max_tokens=5,
        temperature=0.5, top_p=0.9, extra_headers={"traceparent": header})
    spans = receiver.trace(trace_id, 1 + len(CHILDREN))
    root = spans["llm_request"]
    assert root.parent_span_id == span_id
    assert root.service_name == "lmi-serve"
    attributes = root.attributes
    assert attributes["gen_ai.usage.prompt_tokens"] == answer.usage.prompt_tokens
    assert attributes["gen_ai.usage.completion_tokens"] == answer.usage.completion_tokens
    assert attributes["gen_ai.usage.input_tokens"] == answer.usage.prompt_tokens
    assert attributes["gen_ai.response.model"] == MODEL
    assert attributes["gen_ai.request.max_tokens"] == 5
    assert attributes["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attributes["gen_ai.request.n"] == 1
    e2e, ttft = attributes["gen_ai.latency.e2e"], attributes["gen_ai.latency.time_to_first_token"]
    assert 0 <= attributes["gen_ai.latency.time_in_queue"] <= e2e
    assert 0 < ttft <= e2e
    assert root.status_code != 2
    for name in CHILDREN:
        assert spans[name].parent_span_id == root.span_id
        assert root.start_ns <= spans[name].start_ns <= spans[name].end_ns <= root.end_ns
    assert spans["admission"].end_ns <= spans["prefill"].start_ns
    assert spans["prefill"].end_ns <= spans["stream"].start_ns


def test_a_stream_counts_what_it_streamed_and_its_request_id(traced, receiver):
    trace_id, _, header = parent()
    client = openai.OpenAI(base_url=f"{traced[0]}/v1", api_key="none")
    chunks = client.completions.create(
        model=MODEL, prompt="a b", max_tokens=4, n=2, stream=True,
        stream_options={"include_usage": True},
        extra_headers={"traceparent": header, "X-Request-Id": "req-42"})
    usage = [chunk.usage for chunk in chunks if chunk.usage is not None][-1]
    root = receiver.trace(trace_id, 1 + len(CHILDREN))["llm_request"]
    assert root.attributes["gen_ai.request.id"] == "req-42"
    assert root.attributes["gen_ai.usage.completion_tokens"] == usage.completion_tokens
    assert root.attributes["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    assert root.attributes["gen_ai.usage.num_sequences"] == 2


def test_a_request_the_engine_refused_is_an_error_span(traced, receiver):
    trace_id, _, header = parent()
    answer = requests.post(f"{traced[0]}/invocations", headers={"traceparent": header},
                           json={"inputs": "a [[invalid]]"})
    assert answer.status_code == 424  # LMI's answer to a request the model refused
    root = receiver.trace(trace_id, 1)["llm_request"]
    assert root.status_code == 2  # ERROR
    assert root.attributes["gen_ai.usage.completion_tokens"] == 0


def test_without_a_traceparent_each_request_is_its_own_trace(traced, receiver):
    before = set(receiver.traces())
    for _ in range(2):
        requests.post(f"{traced[0]}/invocations", json={"inputs": "a"}).raise_for_status()
    new: set[str] = set()
    while len(new) < 2:
        span = receiver.spans.get(timeout=60)
        receiver.traces().setdefault(span.trace_id, []).append(span)
        new = set(receiver.traces()) - before
    assert all(len(trace_id) == 32 and int(trace_id, 16) for trace_id in new)


def test_kserve_grpc_metadata_carries_the_trace(traced, receiver):
    trace_id, span_id, header = parent()
    client = triton.InferenceServerClient(traced[1])
    tensor = triton.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([b"a b"], dtype=np.object_))
    client.infer(MODEL, [tensor], headers={"traceparent": header})
    root = receiver.trace(trace_id, 1 + len(CHILDREN))["llm_request"]
    assert root.parent_span_id == span_id
    assert root.attributes["gen_ai.usage.completion_tokens"] > 0


def test_log_lines_carry_the_trace_id(traced, receiver, caplog):
    trace_id, _, header = parent()
    with caplog.at_level(logging.INFO):
        answer = requests.post(f"{traced[0]}/invocations", headers={"traceparent": header},
                               json={"inputs": "a [[invalid]]"})
    assert answer.status_code == 424  # LMI's answer to a request the model refused
    assert any(f"TraceId={trace_id}" in record.getMessage() for record in caplog.records)


def test_http_protobuf_export():
    os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    try:
        with http_receiver() as receiver:
            app = served_app(FakeEngine(), otlp_traces_endpoint=receiver.endpoint)
            trace_id, span_id, header = parent()
            with serving(app) as base:
                answer = requests.post(f"{base}/generate", headers={"traceparent": header},
                                       json={"inputs": "a b", "parameters": {"max_new_tokens": 3,
                                                                              "details": True}})
                answer.raise_for_status()
                root = receiver.trace(trace_id, 1 + len(CHILDREN))["llm_request"]
    finally:
        del os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"]
    assert root.parent_span_id == span_id
    assert root.attributes["gen_ai.usage.completion_tokens"] == \
        answer.json()["details"]["generated_tokens"]


def test_off_nothing_of_opentelemetry_is_loaded():
    script = """
import sys, httpx, asyncio
sys.path.insert(0, "tests")
from fakes import FakeEngine, served_app
app = served_app(FakeEngine())
async def main():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        (await client.post("/invocations", json={"inputs": "a"},
                           headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
         ).raise_for_status()
asyncio.run(main())
print(sorted(name for name in sys.modules if name.startswith("opentelemetry.sdk")
             or name.startswith("opentelemetry.exporter")))
"""
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert loaded.stdout.strip() == "[]"


def test_the_settings_that_turn_traces_on():
    flag = load_config(parse_args(["--otlp-traces-endpoint", "http://collector:4317"]), env={})
    assert flag.otlp_traces_endpoint == "http://collector:4317"
    standard = load_config(parse_args([]),
                           env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces",
                                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
    assert standard.otlp_traces_endpoint == "http://c:4318/v1/traces"
    assert load_config(parse_args([]), env={}).otlp_traces_endpoint is None
    with pytest.raises(ConfigError, match="http/json"):
        load_config(parse_args(["--option", "option.otlp_traces_endpoint=http://c:4318"]),
                    env={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
