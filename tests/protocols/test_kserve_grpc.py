"""KServe V2 over gRPC with `tritonclient.grpc` (and the raw stubs for typed contents), against
a running server on the FakeEngine (its answer echoes the prompt's words) and on SmolLM2."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from fakes import HANG_GUARD_S, FakeEngine, served_app
from server_process import free_port, serving
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

MODEL = "fake-model"


@pytest.fixture(scope="module")
def address(engine) -> Iterator[str]:
    port = free_port()
    with serving(served_app(engine, grpc_host="127.0.0.1", grpc_port=port)):
        yield f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def client(address) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(address)


def prompts(*texts: str) -> triton.InferInput:
    tensor = triton.InferInput("text_input", [len(texts)], "BYTES")
    return tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))


def texts(result) -> list[str]:
    return [item.decode() for item in result.as_numpy("text_output")]


def stream(client, *requests: dict, final: bool = True) -> dict[str, list]:
    """Send each request on one bidirectional stream; every response's (text, final flag) or
    error, by request id, until each request has had its final response."""
    received: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    try:
        for request in requests:
            client.async_stream_infer(MODEL, enable_empty_final_response=final, **request)
        by_id: dict[str, list] = {r["request_id"]: [] for r in requests}
        open_ids = set(by_id)
        while open_ids:
            result, error = received.get(timeout=30)
            if error is not None:
                raise error
            response = result.get_response()
            done = response.parameters["triton_final_response"].bool_param
            by_id[response.id].append((texts(result)[0], done))
            if done:
                open_ids.discard(response.id)
        return by_id
    finally:
        client.stop_stream()


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, "1")
    server = client.get_server_metadata()
    assert server.name == "lmi-serve" and "binary_tensor_data" in server.extensions
    model = client.get_model_metadata(MODEL)
    assert (model.name, list(model.versions)) == (MODEL, ["1"])
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [
        ("text_input", "BYTES", [-1])]
    assert [(t.name, t.datatype, list(t.shape)) for t in model.outputs] == [
        ("text_output", "BYTES", [-1])]


def test_infer_raw_contents_one_and_several_prompts(client):
    one = client.infer(MODEL, [prompts("a b")], parameters={"max_new_tokens": 3},
                       request_id="r1")
    assert texts(one) == [" a b a"] and one.get_response().id == "r1"
    several = client.infer(MODEL, [prompts("a b", "c")], parameters={"max_new_tokens": 2})
    assert texts(several) == [" a b", " c c"]


def test_infer_typed_contents(address):
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        tensor = service_pb2.ModelInferRequest.InferInputTensor(
            name="text_input", datatype="BYTES", shape=[2],
            contents=service_pb2.InferTensorContents(bytes_contents=[b"x y", b"z"]))
        request = service_pb2.ModelInferRequest(model_name=MODEL, inputs=[tensor])
        request.parameters["max_new_tokens"].int64_param = 2
        response = stub.ModelInfer(request)
    result = triton.InferResult(response)
    assert texts(result) == [" x y", " z z"]


def test_streaming_sends_one_response_per_token_that_make_the_unary_answer(client):
    unary = texts(client.infer(MODEL, [prompts("p q r")], parameters={"max_new_tokens": 5}))[0]
    pieces = stream(client, {"inputs": [prompts("p q r")], "request_id": "s1",
                             "parameters": {"max_new_tokens": 5}})["s1"]
    assert [text for text, _ in pieces] == [" p", " q", " r", " p", " q"]
    assert "".join(text for text, _ in pieces) == unary
    assert [final for _, final in pieces] == [False] * 4 + [True]


def test_several_requests_stream_on_one_stream(client):
    answers = stream(client, {"inputs": [prompts("a")], "request_id": "x",
                              "parameters": {"max_new_tokens": 2}},
                     {"inputs": [prompts("b c")], "request_id": "y",
                      "parameters": {"max_new_tokens": 3}})
    assert "".join(t for t, _ in answers["x"]) == " a a"
    assert "".join(t for t, _ in answers["y"]) == " b c b"


def test_a_refused_streamed_request_is_an_error_on_the_stream(client):
    with pytest.raises(InferenceServerException, match="a streamed request takes one prompt"):
        stream(client, {"inputs": [prompts("a", "b")], "request_id": "z"})


@pytest.mark.parametrize(("call", "code", "message"), [
    (lambda c: c.infer("other", [prompts("a")]), "StatusCode.NOT_FOUND", "not served here"),
    (lambda c: c.infer(MODEL, [prompts("a")], model_version="3"), "StatusCode.NOT_FOUND",
     "no version '3'"),
    (lambda c: c.infer(MODEL, [triton.InferInput("text_input", [1], "FP32").set_data_from_numpy(
        np.array([1.0], dtype=np.float32))]), "StatusCode.INVALID_ARGUMENT",
     "has datatype FP32; expected BYTES"),
    (lambda c: c.infer(MODEL, [prompts("a")], parameters={"top_k": "all"}),
     "StatusCode.INVALID_ARGUMENT", "parameters.top_k"),
    (lambda c: c.get_model_metadata("other"), "StatusCode.NOT_FOUND", "not served here"),
    # What no engine can run is refused at once, never left to run until the deadline.
    (lambda c: c.infer(MODEL, [prompts("a")], parameters={"max_new_tokens": 2**62}),
     "StatusCode.INVALID_ARGUMENT", "parameters.max_new_tokens"),
    (lambda c: c.infer(MODEL, [prompts("a")], parameters={"max_new_tokens": 10**9}),
     "StatusCode.INVALID_ARGUMENT", "parameters.max_new_tokens"),
    (lambda c: c.infer(MODEL, [prompts("a")], parameters={"repetition_penalty": 1e308}),
     "StatusCode.INVALID_ARGUMENT", "parameters.repetition_penalty"),
])
def test_errors_are_grpc_status_codes(client, call, code, message):
    with pytest.raises(InferenceServerException) as caught:
        call(client)
    assert caught.value.status() == code and message in caught.value.message()


def test_triton_timeout_is_deadline_exceeded_and_frees_the_request():
    """A request that never finishes (the engine stalls it) ends by its Triton `timeout`, and
    what reached the engine is aborted: whether the 50 ms pass before or after the engine gets
    it, nothing is left running."""
    engine = FakeEngine()
    port = free_port()
    with serving(served_app(engine, grpc_host="127.0.0.1", grpc_port=port)):
        slow = triton.InferenceServerClient(f"127.0.0.1:{port}")
        with pytest.raises(InferenceServerException) as caught:
            slow.infer(MODEL, [prompts("a [[stall:0]]")], timeout=50_000,  # microseconds
                       client_timeout=HANG_GUARD_S)
    assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "deadline of 0.05 s (the request's timeout)" in caught.value.message()
    assert engine.finished == []
    assert engine.aborted == [request.request_id for request in engine.requests]


@pytest.mark.e2e
def test_grpc_on_smollm2_streams_what_it_answers_whole(served):
    client = triton.InferenceServerClient(served.grpc)
    parameters = {"max_new_tokens": 12, "temperature": 0}
    model = "smollm2-135m-instruct"
    whole = texts(client.infer(model, [prompts("The capital of France is")],
                               parameters=parameters))[0]
    received: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    client.async_stream_infer(model, [prompts("The capital of France is")], request_id="e",
                              parameters=parameters, enable_empty_final_response=True)
    pieces, done = [], False
    while not done:
        result, error = received.get(timeout=60)
        assert error is None
        pieces.append(texts(result)[0])
        done = result.get_response().parameters["triton_final_response"].bool_param
    client.stop_stream()
    assert "".join(pieces) == whole and "Paris" in whole and len(pieces) > 1
