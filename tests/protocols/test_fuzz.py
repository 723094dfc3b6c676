"""Fuzzing a running server on the FakeEngine: schemathesis against its own `/openapi.json`
(every operation, data that fits the document and data that does not), raw garbage bodies to
every POST route, and malformed KServe V2 gRPC messages. Nothing may answer a server error
(5xx; gRPC UNKNOWN or INTERNAL) or crash the server, and a normal request is answered after.
Every answer schemathesis gets must also match the document (status and body schema).

Bounded and reproducible: hypothesis is derandomized and each operation gets FUZZ_EXAMPLES
examples (env, default 20), so the whole file takes about a minute on two slow cores.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import openapi_spec_validator
import pytest
import schemathesis
import tritonclient.grpc as triton
from fakes import FakeEmbeddingEngine, FakeEngine, served_app
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    response_schema_conformance,
    status_code_conformance,
)
from server_process import free_port
from test_input_limits import BODILESS
from tritonclient.grpc import service_pb2 as pb

from handlers.engine.limits import check_limits
from handlers.engine.types import GenerationRequest, RequestValidationError

MODEL = "fake-model"
EMBEDDER = "fake-embedder"
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "20"))
TIMEOUT = 20  # seconds per request: a hang is a failure, not a stuck test
MAX_SEQUENCES = 8  # as the torch engine refuses more sequences than its batch holds


class BoundedEngine(FakeEngine):
    """The FakeEngine with the real engine's bounds, so fuzzed sizes end: no more sequences
    than a batch holds, no output past the context."""

    def validate(self, request: GenerationRequest) -> None:
        super().validate(request)
        params = request.params
        if params.num_sequences > MAX_SEQUENCES:
            raise RequestValidationError("n", f"{params.num_sequences} sequences exceed "
                                              f"max_rolling_batch_size {MAX_SEQUENCES}")
        params.max_new_tokens = min(params.max_new_tokens, self.max_model_len)


def fuzz_app() -> Any:
    return served_app(BoundedEngine(), FakeEmbeddingEngine(), max_request_size=1024 * 1024)


DOCUMENT = fuzz_app().openapi()  # the operations to fuzz, known at collection
SCHEMA = schemathesis.openapi.from_dict(DOCUMENT)
OPERATIONS = [(method.upper(), path) for path, ops in DOCUMENT["paths"].items()
              for method in ops]
POSTS = [path for method, path in OPERATIONS if method == "POST"]
SERVED_PATHS = {"model": MODEL, "version": "1", "name": "endpoint"}


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def engine() -> BoundedEngine:
    return BoundedEngine()


@pytest.fixture(scope="module")
def app(engine, grpc_port) -> Any:
    return served_app(engine, FakeEmbeddingEngine(), max_request_size=1024 * 1024,
                      grpc_host="127.0.0.1", grpc_port=grpc_port)


def answers_normally(url: str) -> None:
    body = {"inputs": "a b c", "parameters": {"max_new_tokens": 3}}
    reply = httpx.post(f"{url}/invocations", json=body, timeout=TIMEOUT)
    assert reply.status_code == 200 and reply.json() == {"generated_text": " a b c"}
    assert httpx.get(f"{url}/ping", timeout=TIMEOUT).status_code == 200


# --- the document -------------------------------------------------------------------------------


def test_openapi_json_and_docs_are_served(url):
    served = httpx.get(f"{url}/openapi.json", timeout=TIMEOUT)
    assert served.status_code == 200 and served.json() == DOCUMENT
    assert DOCUMENT["openapi"].startswith("3.")
    docs = httpx.get(f"{url}/docs", timeout=TIMEOUT)
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_the_document_is_valid_openapi():
    openapi_spec_validator.validate(DOCUMENT)


def test_every_route_is_documented_with_its_bodies():
    for method, path in OPERATIONS:
        operation = DOCUMENT["paths"][path][method.lower()]
        assert operation.get("summary") and operation["responses"], (method, path)
        if method == "POST" and path not in BODILESS:  # those read no body
            assert "application/json" in operation["requestBody"]["content"], path
            assert any(status >= "400" for status in operation["responses"]), path


def test_request_schemas_are_the_protocols_own_fields():
    schemas = DOCUMENT["components"]["schemas"]
    assert {"inputs", "parameters", "stream"} <= set(schemas["LmiRequest"]["properties"])
    assert "max_new_tokens" in schemas["LmiParameters"]["properties"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert "text_input" in schemas["GenerateRequest"]["required"]
    assert schemas["RestInferRequest"]["additionalProperties"] is False  # KServe V2 is strict
    assert "instances" in schemas["V1Request"]["required"]
    chat = DOCUMENT["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    assert chat["responses"]["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/OpenAIErrorBody"}


# --- schemathesis ---------------------------------------------------------------------------


def _strategy(method: str, path: str) -> st.SearchStrategy:
    """Cases that fit the document and cases that do not, against any model name and
    against the served one (so the protocol handlers, not only the 404s, are reached)."""
    operation = SCHEMA[path][method]
    names = {p["name"] for p in DOCUMENT["paths"][path][method.lower()].get("parameters", [])
             if p["in"] == "path"}
    served = {name: value for name, value in SERVED_PATHS.items() if name in names}
    strategies = []
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        strategies.append(operation.as_strategy(mode, path_parameters=served or None))
        if served:
            strategies.append(operation.as_strategy(mode))
    return st.one_of(strategies)


def _allowed(method: str, path: str, status: int) -> bool:
    """No server error, but for a 501 the operation documents (KServe V1's :explain)."""
    documented = DOCUMENT["paths"][path][method.lower()]["responses"]
    return status < 500 or (status == 501 and "501" in documented)


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_schemathesis_finds_no_server_error(url, method, path):
    @given(case=_strategy(method, path))
    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                     HealthCheck.data_too_large])
    def fuzz(case: Any) -> None:
        response = case.call(base_url=url, timeout=TIMEOUT)
        assert _allowed(method, path, response.status_code), \
            f"{response.status_code} for {case.as_curl_command()}:\n{response.text[:2000]}"
        # The document tells the truth: every answer has a documented status and shape.
        case.validate_response(response, checks=[status_code_conformance,
                                                 response_schema_conformance])

    fuzz()
    answers_normally(url)


# --- raw garbage ----------------------------------------------------------------------------

NESTED = b"[" * 100_000 + b"]" * 100_000
GARBAGE: list[tuple[str, bytes, str]] = [
    ("random bytes", bytes(range(256)) * 4, "application/octet-stream"),
    ("empty", b"", "application/json"),
    ("truncated JSON", b'{"inputs": "a b", "parameters": {"max_new_', "application/json"),
    ("not UTF-8", b'{"inputs": "\xff\xfe"}', "application/json"),
    ("form", b"inputs=a+b&stream=true", "application/x-www-form-urlencoded"),
    ("text", b"hello", "text/plain"),
    ("huge number", b'{"inputs": "a", "parameters": {"max_new_tokens": 1' + b"0" * 400 + b"}}",
     "application/json"),
    ("huge float", b'{"inputs": "a", "parameters": {"temperature": 1e400}}', "application/json"),
    ("NaN", b'{"inputs": "a", "parameters": {"temperature": NaN, "top_p": Infinity}}',
     "application/json"),
    ("deeply nested", NESTED, "application/json"),
    ("nested inputs", b'{"inputs": ' + NESTED + b"}", "application/json"),
    ("null", b"null", "application/json"),
    ("array", b"[1, 2, 3]", "application/json"),
    ("string", b'"inputs"', "application/json"),
    ("number", b"-0.0e-0", "application/json"),
    ("duplicate keys", b'{"inputs": "a", "inputs": 3}', "application/json"),
    ("lone surrogate", b'{"inputs": "\\ud800", "prompt": "\\udfff"}', "application/json"),
]
# Every field any protocol reads, each given the wrong type in turn.
FIELDS = ["inputs", "parameters", "stream", "messages", "prompt", "input", "model", "n",
          "max_tokens", "temperature", "stop", "text_input", "id", "instances", "inputs",
          "outputs", "tools", "tool_choice", "response_format", "logit_bias", "best_of",
          "stream_options", "encoding_format", "dimensions", "echo", "logprobs",
          "frequency_penalty", "presence_penalty", "repetition_penalty", "top_p", "seed",
          "stop_token_ids", "min_tokens", "min_p"]
PARAMETERS = ["max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "n",
              "best_of", "details", "grammar", "truncate", "timeout", "priority",
              "decoder_input_details", "top_n_tokens", "return_full_text", "stop_token_ids",
              "repetition_penalty", "presence_penalty", "frequency_penalty", "typical_p",
              "min_p", "min_new_tokens"]
# Wrong types, and numbers no sampler can run (past float32, denormal, past 64 bits).
WRONG = [None, True, -1, 2**70, 1.5, -1e308, "x", "", [], [None], {}, {"a": [1]}, [[[]]],
         1e308, 1e-320, 2**63, [2**63], {"5": 1e300}]


def _wrong_bodies(route: int) -> list[Any]:
    """Every field with a few wrong values; each route gets other ones (bounded, and all of
    WRONG goes to every field over the routes)."""
    def values(i: int) -> list[Any]:
        return [WRONG[(route * 2 + i + k) % len(WRONG)] for k in range(2)]

    short = {"inputs": "a b", "prompt": "a", "max_tokens": 2, "parameters": {"max_new_tokens": 2}}
    bodies: list[Any] = []
    for i, name in enumerate(FIELDS):
        bodies += [{**short, name: value} for value in values(i)]
        bodies += [{name: value} for value in values(i + 1)]
    for i, name in enumerate(PARAMETERS):
        bodies += [{"inputs": "a b", "text_input": "a b", "parameters": {name: value}}
                   for value in values(i)]
    bodies += [{"messages": [{"role": "user", "content": value}]} for value in WRONG]
    bodies += [{"instances": [value]} for value in WRONG]
    bodies += [{"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": value,
                            "data": value}]} for value in WRONG]
    return bodies


def _concrete(path: str) -> str:
    return path.replace("{model}", MODEL).replace("{version}", "1").replace("{name}", "e")


@pytest.mark.parametrize("path", POSTS)
def test_garbage_bodies_get_no_server_error(url, path):
    target = url + _concrete(path)
    failures = []
    with httpx.Client(timeout=TIMEOUT) as client:
        sent = [(name, body, {"content-type": kind}) for name, body, kind in GARBAGE]
        sent += [("binary header", b'{"inputs": []}', {"Inference-Header-Content-Length": h})
                 for h in ("-1", "99999999999999999999", "x", "0")]
        for name, body, headers in sent:
            reply = client.post(target, content=body, headers=headers)
            if not _allowed("POST", path, reply.status_code):
                failures.append((name, reply.status_code, reply.text[:300]))
        for body in _wrong_bodies(POSTS.index(path)):
            reply = client.post(target, json=body)
            if not _allowed("POST", path, reply.status_code):
                failures.append((body, reply.status_code, reply.text[:300]))
    assert not failures
    answers_normally(url)


def test_nothing_the_fuzzing_sent_reached_the_engine_past_its_limits(url, engine):
    """Whatever the sweeps above sent, each request the engine ran is one it can run: every
    out-of-range setting was refused (a 4xx) or never read, not handed on."""
    assert engine.requests  # the sweeps ran (this module's tests run in order)
    for request in engine.requests:
        check_limits(request, engine.tokenizer.vocab_size, engine.max_model_len)


# --- gRPC -------------------------------------------------------------------------------------

INFER = "/inference.GRPCInferenceService/ModelInfer"
SERVER_ERRORS = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


def _tensor(**fields: Any) -> pb.ModelInferRequest.InferInputTensor:
    return pb.ModelInferRequest.InferInputTensor(**fields)


def _text(*items: bytes) -> pb.InferTensorContents:
    return pb.InferTensorContents(bytes_contents=list(items))


MALFORMED = [
    pb.ModelInferRequest(),
    pb.ModelInferRequest(model_name=MODEL),
    pb.ModelInferRequest(model_name="other", inputs=[_tensor(name="text_input")]),
    pb.ModelInferRequest(model_name=MODEL, model_version="7"),
    pb.ModelInferRequest(model_name=MODEL, inputs=[_tensor(name="text_input", datatype="BYTES",
                                                          shape=[1])]),
    pb.ModelInferRequest(model_name=MODEL, inputs=[_tensor(name="text_input", datatype="FP32",
                                                          shape=[1], contents=_text(b"a"))]),
    pb.ModelInferRequest(model_name=MODEL, inputs=[_tensor(name="text_input", datatype="BYTES",
                                                          shape=[-1], contents=_text(b"a"))]),
    pb.ModelInferRequest(model_name=MODEL, inputs=[_tensor(name="text_input", datatype="BYTES",
                                                          shape=[2**62, 2**62],
                                                          contents=_text(b"a"))]),
    pb.ModelInferRequest(model_name=MODEL, inputs=[_tensor(name="text_input", datatype="BYTES",
                                                          shape=[3], contents=_text(b"a"))]),
    pb.ModelInferRequest(model_name=MODEL, inputs=[_tensor(name="text_input", datatype="BYTES",
                                                          shape=[1, 1, 1],
                                                          contents=_text(b"a"))]),
    pb.ModelInferRequest(model_name=MODEL, inputs=[_tensor(name="text_input", datatype="BYTES",
                                                          shape=[1],
                                                          contents=_text(b"\xff\xfe"))]),
    pb.ModelInferRequest(model_name=MODEL, inputs=[_tensor(name="text_input", datatype="BYTES",
                                                          shape=[1], contents=_text(b""))]),
    pb.ModelInferRequest(model_name=MODEL, inputs=[_tensor(name="other", datatype="BYTES",
                                                          shape=[1], contents=_text(b"a"))]),
    pb.ModelInferRequest(model_name=MODEL, inputs=[_tensor(name="text_input", datatype="BYTES",
                                                          shape=[1])],
                         raw_input_contents=[b"\x05\x00\x00\x00ab"]),
    pb.ModelInferRequest(model_name=MODEL, inputs=[_tensor(name="text_input", datatype="BYTES",
                                                          shape=[1])],
                         raw_input_contents=[b"\x01\x00"]),
    pb.ModelInferRequest(model_name=MODEL, inputs=[_tensor(name="text_input", datatype="BYTES",
                                                          shape=[1])],
                         raw_input_contents=[b"a", b"b"]),
    pb.ModelInferRequest(model_name=MODEL, outputs=[pb.ModelInferRequest
                                                    .InferRequestedOutputTensor(name="nope")],
                         inputs=[_tensor(name="text_input", datatype="BYTES", shape=[1],
                                         contents=_text(b"a"))]),
]


def _with_parameters(**values: Any) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=MODEL, inputs=[
        _tensor(name="text_input", datatype="BYTES", shape=[1], contents=_text(b"a b"))])
    for key, (kind, value) in values.items():
        setattr(request.parameters[key], kind, value)
    return request


MALFORMED += [
    _with_parameters(max_new_tokens=("string_param", "many")),
    _with_parameters(max_new_tokens=("int64_param", -5)),
    _with_parameters(top_p=("double_param", float("nan"))),
    _with_parameters(seed=("int64_param", -1)),
    _with_parameters(timeout=("string_param", "1s")),
    _with_parameters(timeout=("int64_param", -1)),
    _with_parameters(sequence_id=("int64_param", 1)),
    _with_parameters(n=("int64_param", 2**62)),
]


@pytest.fixture(scope="module")
def channel(url, grpc_port) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as chan:
        yield chan


def _status(call: Any, payload: bytes) -> grpc.StatusCode:
    try:
        call(payload, timeout=TIMEOUT)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@settings(max_examples=EXAMPLES * 5, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=512))
def test_grpc_garbage_bytes_are_not_server_errors(channel, payload):
    raw = channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)
    assert _status(raw, payload) not in SERVER_ERRORS


@pytest.mark.parametrize("request_", MALFORMED, ids=range(len(MALFORMED)))
def test_grpc_malformed_requests_are_invalid_arguments(channel, request_):
    raw = channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)
    code = _status(raw, request_.SerializeToString())
    assert code not in SERVER_ERRORS and code != grpc.StatusCode.OK, code


def test_grpc_answers_normally_after_the_garbage(url, grpc_port, channel):
    raw = channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)
    for payload in (b"\x0a\xff\xff\xff\xff\x0f", b"\x00" * 64, b"\xff" * 64):
        assert _status(raw, payload) not in SERVER_ERRORS
    client = triton.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    tensor = triton.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([b"x y"], dtype=np.object_))
    result = client.infer(MODEL, [tensor], parameters={"max_new_tokens": 2})
    assert [t.decode() for t in result.as_numpy("text_output")] == [" x y"]
    answers_normally(url)


def test_grpc_garbage_on_a_stream_is_an_error_message_on_it(channel):
    stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                   request_serializer=None, response_deserializer=None)
    answers = [pb.ModelStreamInferResponse.FromString(raw)
               for raw in stream(iter([b"\xff" * 16]), timeout=TIMEOUT)]
    assert [a.error_message.split(":")[0] for a in answers] == [
        "the request message does not parse"]
