"""KServe V1 and the V2 Open Inference Protocol over REST, with the clients KServe users have:
`tritonclient.http` with its defaults (BYTES tensors in Triton's binary extension) and plain
HTTP, against a running server on the FakeEngine (tests/fakes.py: the answer echoes the prompt's
words) and on the real SmolLM2."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from fakes import HANG_GUARD_S, FakeEmbeddingEngine, FakeEngine, served_app
from server_process import serving
from tritonclient.utils import InferenceServerException

MODEL = "fake-model"


@pytest.fixture(scope="module")
def app(engine: FakeEngine) -> Any:
    return served_app(engine, FakeEmbeddingEngine())


@pytest.fixture(scope="module")
def client(url) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(url.removeprefix("http://"))


def prompts(*texts: str, binary: bool = True) -> triton.InferInput:
    tensor = triton.InferInput("text_input", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_),
                               binary_data=binary)
    return tensor


def texts(result) -> list[str]:
    """The texts of `text_output` (binary outputs come back as bytes, JSON ones as str)."""
    return [item.decode() if isinstance(item, bytes) else item
            for item in result.as_numpy("text_output")]


def with_binary(header: bytes, binary: bytes) -> tuple[bytes, dict[str, str]]:
    """A body under Triton's binary extension: the JSON header, then the binary data."""
    return header + binary, {"Inference-Header-Content-Length": str(len(header))}


# --- V2: health and metadata --------------------------------------------------------------------


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, "1")
    assert not client.is_model_ready("other")
    server = client.get_server_metadata()
    assert server["name"] == "lmi-serve" and "binary_tensor_data" in server["extensions"]
    model = client.get_model_metadata(MODEL)
    assert model == client.get_model_metadata(MODEL, "1")
    assert model["inputs"] == [{"name": "text_input", "datatype": "BYTES", "shape": [-1]}]
    assert model["outputs"] == [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]
    assert model["versions"] == ["1"] and model["platform"]


def test_readiness_reports_a_model_still_loading():
    with serving(served_app(FakeEngine(), loaded=False)) as url:
        loading = triton.InferenceServerClient(url.removeprefix("http://"))
        assert loading.is_server_live()
        assert not loading.is_server_ready() and not loading.is_model_ready(MODEL)
        with pytest.raises(InferenceServerException) as caught:
            loading.infer(MODEL, [prompts("a")])
        assert caught.value.status() == "503" and "still loading" in caught.value.message()


# --- V2: inference ------------------------------------------------------------------------------


def test_infer_with_the_clients_defaults_binary_in_and_out(client):
    result = client.infer(MODEL, [prompts("a b")], parameters={"max_new_tokens": 3})
    assert texts(result) == [" a b a"]
    response = result.get_response()
    assert response["model_name"] == MODEL and response["model_version"] == "1"
    assert response["outputs"][0]["parameters"]["binary_data_size"] > 0  # came as binary


def test_infer_several_prompts_in_json_with_the_id_echoed(client):
    outputs = [triton.InferRequestedOutput("text_output", binary_data=False)]
    result = client.infer(MODEL, [prompts("a b", "c", binary=False)], outputs=outputs,
                          request_id="req-7", parameters={"max_new_tokens": 2})
    assert texts(result) == [" a b", " c c"]
    response = result.get_response()
    assert response["id"] == "req-7" and response["outputs"][0]["data"] == [" a b", " c c"]
    assert response["outputs"][0]["shape"] == [2]


def test_infer_over_plain_json_and_versioned_routes(url):
    body = {"inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES",
                        "data": [["x y"]]}], "parameters": {"max_new_tokens": 2,
                                                            "return_full_text": True}}
    for path in (f"/v2/models/{MODEL}/infer", f"/v2/models/{MODEL}/versions/1/infer"):
        response = httpx.post(url + path, json=body)
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        assert response.json()["outputs"] == [
            {"name": "text_output", "datatype": "BYTES", "shape": [1], "data": ["x y x y"]}]


def test_an_empty_outputs_list_returns_no_tensor(url):
    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                        "data": ["x"]}], "outputs": []}
    assert httpx.post(f"{url}/v2/models/{MODEL}/infer", json=body).json()["outputs"] == []


def test_triton_timeout_ends_the_request_and_frees_it():
    """A request that never finishes (the engine stalls it) ends by its Triton `timeout`, and
    what reached the engine is aborted: whether the 50 ms pass before or after the engine gets
    it, nothing is left running."""
    engine = FakeEngine()
    with serving(served_app(engine)) as url:
        slow = triton.InferenceServerClient(url.removeprefix("http://"),
                                            network_timeout=HANG_GUARD_S)
        with pytest.raises(InferenceServerException) as caught:
            slow.infer(MODEL, [prompts("a [[stall:0]]")], timeout=50_000)  # microseconds
    assert caught.value.status() == "408"
    assert "deadline of 0.05 s (the request's timeout)" in caught.value.message()
    assert engine.finished == []
    assert engine.aborted == [request.request_id for request in engine.requests]


@pytest.mark.parametrize(("tensor", "message"), [
    (lambda: triton.InferInput("text_input", [1], "FP32").set_data_from_numpy(
        np.array([1.0], dtype=np.float32)), "input 'text_input' has datatype FP32; expected BYTES"),
    (lambda: triton.InferInput("prompt", [1], "BYTES").set_data_from_numpy(
        np.array([b"a"], dtype=np.object_)), "unknown input 'prompt'"),
    (lambda: triton.InferInput("text_input", [3], "BYTES").set_data_from_numpy(
        np.array([b"a", b"b", b"c"], dtype=np.object_)).set_shape([2]),
     "input 'text_input' has shape [2] (2 elements) but 3 data elements"),
])
def test_bad_tensors_are_400s_that_say_what_is_wrong(client, tensor, message):
    with pytest.raises(InferenceServerException) as caught:
        client.infer(MODEL, [tensor()])
    assert caught.value.status() == "400" and message in caught.value.message()


@pytest.mark.parametrize(("parameters", "message"), [
    ({"max_new_tokens": 0}, "parameters.max_new_tokens: Input should be greater than or equal"),
    ({"top_p": 7.5}, "parameters.top_p"),
    ({"temperature": "hot"}, "parameters.temperature"),
])
def test_bad_generation_parameters_are_400s(client, parameters, message):
    with pytest.raises(InferenceServerException) as caught:
        client.infer(MODEL, [prompts("a")], parameters=parameters)
    assert caught.value.status() == "400" and message in caught.value.message()


def test_unknown_model_version_and_output_are_refused(client):
    for call, status, message in [
        (lambda: client.infer("other", [prompts("a")]), "404", "model 'other' is not served"),
        (lambda: client.infer(MODEL, [prompts("a")], model_version="7"), "404", "no version '7'"),
        (lambda: client.infer(MODEL, [prompts("a")], outputs=[
            triton.InferRequestedOutput("logits")]), "400", "unknown output 'logits'"),
        (lambda: client.get_model_metadata("other"), "404", "not served"),
    ]:
        with pytest.raises(InferenceServerException) as caught:
            call()
        assert caught.value.status() == status and message in caught.value.message()


@pytest.mark.parametrize(("body", "headers", "message"), [
    (b"{broken", {}, "the request's JSON is not valid"),
    (b'{"inputs": "x"}', {}, "inputs: Input should be a valid list"),
    (b'{"inputs": []}', {}, "inputs: List should have at least 1 item"),
    (b'{"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", '
     b'"parameters": {"binary_data_size": 9}}]}', {}, "binary_data_size 9 does not fit"),
    (*with_binary(b'{"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", '
                  b'"data": ["a"]}]}', b"junk"), "binary data that no input claims"),
    (*with_binary(b'{"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", '
                  b'"parameters": {"binary_data_size": 6}}]}', b"\x09\x00\x00\x00ab"),
     "ends inside an element"),
    (b"{}", {"Inference-Header-Content-Length": "99"}, "is not a length within the 2-byte body"),
    (b'{"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [5]}]}',
     {}, "every element must be a non-empty string"),
    (b'{"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["a"]}],'
     b' "parameters": {"sequence_id": 3}}', {}, "sequence batching is not supported"),
])
def test_malformed_requests_are_400s_in_v2s_shape(url, body, headers, message):
    response = httpx.post(f"{url}/v2/models/{MODEL}/infer", content=body, headers=headers)
    assert response.status_code == 400
    assert message in response.json()["error"] and set(response.json()) == {"error"}


# --- V1 -----------------------------------------------------------------------------------------


def test_v1_model_readiness_and_the_merged_model_list(url):
    assert httpx.get(f"{url}/v1/models/{MODEL}").json() == {"name": MODEL, "ready": True}
    assert httpx.get(f"{url}/v1/models").json()["models"] == [MODEL, "fake-embedder"]
    missing = httpx.get(f"{url}/v1/models/other")
    assert missing.status_code == 404 and "other" in missing.json()["error"]


def test_v1_predict_strings_and_objects(url):
    body = {"instances": ["a b", {"text": "c d", "max_new_tokens": 1},
                          {"prompt": "e", "parameters": {"max_new_tokens": 2,
                                                         "return_full_text": True}}]}
    response = httpx.post(f"{url}/v1/models/{MODEL}:predict", json=body)
    assert response.status_code == 200
    predictions = response.json()["predictions"]
    assert predictions[1:] == [" c", "e e e"] and predictions[0].startswith(" a b a b")


def test_v1_request_parameters_apply_to_every_instance_which_may_override_them(url):
    body = {"instances": ["a b", {"text": "c d", "max_new_tokens": 1},
                          {"prompt": "e", "parameters": {"return_full_text": True}}],
            "parameters": {"max_new_tokens": 3}}
    response = httpx.post(f"{url}/v1/models/{MODEL}:predict", json=body)
    assert response.status_code == 200
    assert response.json()["predictions"] == [" a b a", " c", "e e e e"]


def test_v1_predict_on_the_embedding_model_gives_vectors(url):
    response = httpx.post(f"{url}/v1/models/fake-embedder:predict", json={"instances": ["a b"]})
    assert response.json() == {"predictions": [[2.0, 3.0, 0.5, -1.0]]}


@pytest.mark.parametrize(("path", "body", "status", "message"), [
    (f"/v1/models/{MODEL}:predict", {"instances": []}, 400, "instances: must not be empty"),
    (f"/v1/models/{MODEL}:predict", {"inputs": "x"}, 400, "'instances' list"),
    (f"/v1/models/{MODEL}:predict", {"instances": [{"max_new_tokens": 2}]}, 400,
     "instances[0]: expected one non-empty prompt string"),
    (f"/v1/models/{MODEL}:predict", {"instances": [{"text": "a", "top_k": "many"}]}, 400,
     "instances[0].top_k"),
    (f"/v1/models/{MODEL}:predict", {"instances": ["a"], "parameters": {"max_new_tokens": 0}},
     400, "parameters.max_new_tokens: Input should be greater than or equal to 1"),
    (f"/v1/models/{MODEL}:predict", {"instances": ["a"], "parameters": [1]}, 400,
     "parameters: expected an object"),
    ("/v1/models/other:predict", {"instances": ["a"]}, 404, "Model with name other does not"),
    (f"/v1/models/{MODEL}:explain", {"instances": ["a"]}, 501, "explain is not supported"),
])
def test_v1_errors(url, path, body, status, message):
    response = httpx.post(url + path, json=body)
    assert response.status_code == status and message in response.json()["error"]


# --- the real model -----------------------------------------------------------------------------


@pytest.mark.e2e
def test_triton_client_on_smollm2_answers_as_the_lmi_route(served):
    client = triton.InferenceServerClient(served.url.removeprefix("http://"))
    parameters = {"max_new_tokens": 12, "temperature": 0}
    result = client.infer("smollm2-135m-instruct", [prompts("The capital of France is",
                                                           "Deep learning is")],
                          parameters=parameters)
    lmi = [httpx.post(f"{served.url}/invocations", timeout=60, json={
        "inputs": text, "parameters": parameters}).json()["generated_text"]
        for text in ("The capital of France is", "Deep learning is")]
    assert texts(result) == lmi and "Paris" in lmi[0]


@pytest.mark.e2e
def test_v1_readme_example_takes_its_max_new_tokens(served):
    """The README's body: the request's `parameters` bound every instance's answer."""
    parameters = {"max_new_tokens": 8, "temperature": 0}
    v1 = httpx.post(f"{served.url}/v1/models/smollm2-135m-instruct:predict", timeout=60, json={
        "instances": ["The capital of France is"], "parameters": parameters}).json()
    lmi = httpx.post(f"{served.url}/invocations", timeout=60, json={
        "inputs": "The capital of France is", "parameters": {**parameters, "details": True}})
    assert lmi.json()["details"]["generated_tokens"] == 8
    assert v1["predictions"] == [lmi.json()["generated_text"]]
