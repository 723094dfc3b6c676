"""Input limits, from a client's side: a body over `max_request_size` (declared or streamed
without a Content-Length) is refused on every POST route in its protocol's shape, as is a gRPC
message over it (RESOURCE_EXHAUSTED); deeply nested JSON and JSON of very many objects are
refused with a 400-class answer, never a 500; the connection and the server keep serving."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as triton
from fakes import FakeEmbeddingEngine, FakeEngine, served_app
from server_process import free_port
from starlette.requests import Request
from tritonclient.utils import InferenceServerException

from handlers.config import load_config, parse_args
from handlers.server.http.body import BodyError, read_body
from handlers.server.http.json_limits import MAX_CONTAINERS, MAX_DEPTH

LIMIT = 4096
TOO_LARGE = f"request body is larger than the limit of {LIMIT} bytes"
MODEL = "fake-model"

# Every POST route that reads a body, with a body it answers 200 and how it refuses one.
LMI, SAGEMAKER, OPENAI, KSERVE, TGI = "lmi", "sagemaker", "openai", "kserve", "tgi"
ANTHROPIC = "anthropic"
CHAT = {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 2}
INFER = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["a b"]}]}
ROUTES = {
    "/invocations": (LMI, {"inputs": "a b"}),
    "/predictions/{model}": (LMI, {"inputs": "a b"}),
    "/endpoints/{name}/invocations": (SAGEMAKER, {"inputs": "a b"}),
    "/endpoints/{name}/invocations-response-stream": (SAGEMAKER, {"inputs": "a b"}),
    "/v1/chat/completions": (OPENAI, CHAT),
    "/v1/completions": (OPENAI, {"prompt": "a b", "max_tokens": 2}),
    "/v1/responses": (OPENAI, {"input": "a b", "max_output_tokens": 2}),
    "/v1/embeddings": (OPENAI, {"input": "a b"}),
    "/serving-endpoints/{model}/invocations": (OPENAI, CHAT),
    "/v1/messages": (ANTHROPIC, CHAT),
    "/v1/messages/count_tokens": (ANTHROPIC, {"messages": CHAT["messages"]}),
    "/tokenize": (OPENAI, {"prompt": "a b"}),
    "/detokenize": (OPENAI, {"tokens": [1, 2]}),
    "/v1/models/{model}:predict": (KSERVE, {"instances": ["a b"]}),
    "/v2/models/{model}/infer": (KSERVE, INFER),
    "/v2/models/{model}/versions/{version}/infer": (KSERVE, INFER),
    "/v2/models/{model}/generate": (KSERVE, {"text_input": "a b"}),
    "/v2/models/{model}/generate_stream": (KSERVE, {"text_input": "a b"}),
    "/v2/models/{model}/versions/{version}/generate": (KSERVE, {"text_input": "a b"}),
    "/v2/models/{model}/versions/{version}/generate_stream": (KSERVE, {"text_input": "a b"}),
    "/generate": (TGI, {"inputs": "a b"}),
    "/generate_stream": (TGI, {"inputs": "a b"}),
    "/": (TGI, {"inputs": "a b"}),
    "/models/{model}/invoke": (LMI, {"inputs": "a b"}),  # the server's own model, by name
}
BODILESS = {"/v1/models/{model}:explain",  # answers 501 without reading a body
            # DJL's adapter management reads its query (test_adapter_management.py)
            *(f"{prefix}/adapters{tail}" for prefix in ("", "/models/{model}")
              for tail in ("", "/{name}/update"))}
# vLLM's adapter loading and SageMaker's model loading read JSON bodies;
# test_adapter_management.py and test_multi_model.py test their limits
MANAGEMENT = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/models"}


def url_of(route: str) -> str:
    return route.format(model=MODEL, name="endpoint", version="1")


def post_routes(app) -> set[str]:
    routes = set()
    for route in app.router.routes:
        for sub in getattr(getattr(route, "original_router", None), "routes", [route]):
            if "POST" in (getattr(sub, "methods", None) or ()):
                routes.add(sub.path)
    return routes


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def app(grpc_port):
    return served_app(FakeEngine(), FakeEmbeddingEngine(), max_request_size=LIMIT,
                      grpc_host="127.0.0.1", grpc_port=grpc_port)


@pytest.fixture
def client(url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=60) as session:  # one keep-alive connection
        yield session


def assert_refused(response: httpx.Response, shape: str, message: str, status: int) -> None:
    """The refusal in the protocol's shape: `status` (SageMaker: the container's, inside a
    ModelError) and `message`."""
    body = response.json()
    if shape == SAGEMAKER:
        assert response.status_code == 424
        assert response.headers["x-amzn-errortype"] == "ModelError"
        assert body["OriginalStatusCode"] == (424 if status == 400 else status)
        assert message in body["OriginalMessage"]
        return
    if shape == LMI:
        assert (response.status_code, body) == ((424 if status == 400 else status),
                                                {"error": message, "code": response.status_code})
    elif shape == OPENAI:
        assert response.status_code == status
        assert body["error"]["message"] == message
        assert body["error"]["type"] == "invalid_request_error"
    elif shape == ANTHROPIC:
        kind = "request_too_large" if status == 413 else "invalid_request_error"
        assert (response.status_code, body) == (
            status, {"type": "error", "error": {"type": kind, "message": message}})
    elif shape == KSERVE:
        assert (response.status_code, body) == (status, {"error": message})
    else:  # TGI: 422 for what does not validate
        assert response.status_code == (422 if status == 400 else status)
        assert body["error"] == f"Input validation error: {message}"
        assert body["error_type"] == "validation"


def test_every_post_route_is_covered(app):
    assert post_routes(app) == set(ROUTES) | BODILESS | MANAGEMENT


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_body_over_the_limit_is_413_and_the_connection_serves_on(client, route):
    shape, good = ROUTES[route]
    padded = {**good, "padding": "x" * LIMIT}
    response = client.post(url_of(route), content=orjson.dumps(padded))
    assert_refused(response, shape, TOO_LARGE, 413)
    assert client.post(url_of(route), content=orjson.dumps(good)).status_code == 200


def chunks(total: int, size: int = 1024) -> Iterator[bytes]:
    """A JSON-looking body of `total` bytes, sent chunked (no Content-Length)."""
    yield b'{"inputs": "'
    for _ in range(total // size):
        yield b"x" * size
    yield b'"}'


@pytest.mark.parametrize("route", ["/invocations", "/v1/chat/completions",
                                   "/v2/models/{model}/infer", "/generate"])
def test_a_chunked_body_over_the_limit_is_413(client, route):
    shape, good = ROUTES[route]
    response = client.post(url_of(route), content=chunks(4 * LIMIT))
    assert "content-length" not in response.request.headers
    assert_refused(response, shape, TOO_LARGE, 413)
    assert client.post(url_of(route), content=orjson.dumps(good)).status_code == 200


async def test_a_streamed_body_is_cut_off_at_the_limit_not_read_whole():
    """A body that never ends: reading stops once the limit is passed."""
    pulled = 0

    async def receive() -> dict:
        nonlocal pulled
        pulled += 1000
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    with pytest.raises(BodyError) as refused:
        await read_body(request, LIMIT)
    assert refused.value.message == TOO_LARGE
    assert pulled <= LIMIT + 1000


@pytest.fixture(scope="module")
def roomy_app():
    """An app whose size limit lets the shapes below through, to be refused for their shape."""
    return served_app(FakeEngine(), FakeEmbeddingEngine(), max_request_size=8 * 1024 * 1024)


async def post_then_good(app, route: str, body: bytes) -> httpx.Response:
    """POST `body`; then a good body to the same route must still be answered 200."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://x", timeout=60) as client:
        response = await client.post(url_of(route), content=body)
        good = ROUTES[route][1]
        assert (await client.post(url_of(route), content=orjson.dumps(good))).status_code == 200
    return response


def with_field(route: str, value: bytes) -> bytes:
    """The route's good body with its first field replaced by raw JSON `value`."""
    field = next(iter(ROUTES[route][1]))
    return b'{"' + field.encode() + b'": ' + value + b"}"


def nested(depth: int) -> bytes:
    return b"[" * depth + b'"a"' + b"]" * depth


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 950, 100_000])
async def test_deeply_nested_json_is_refused_never_a_500(roomy_app, route, depth):
    """orjson itself refuses more than 1024 levels; 950 would pass it, and code that walks such
    a value recursively would fail (a 500): what nests past MAX_DEPTH is refused first."""
    response = await post_then_good(roomy_app, route, with_field(route, nested(depth)))
    message = f"the JSON body nests deeper than {MAX_DEPTH} levels" if depth < 1000 else \
        f"the JSON body holds more than {MAX_CONTAINERS} objects and arrays"
    assert_refused(response, ROUTES[route][0], message, 400)


@pytest.mark.parametrize("route", ["/v1/completions", "/v2/models/{model}/infer", "/generate",
                                   "/invocations", "/v1/chat/completions"])
async def test_two_million_tiny_objects_are_refused_before_decoding(roomy_app, route):
    """6 MB of `{}` (within SageMaker's 6 MiB) would decode to ~200 MB and take pydantic tens
    of seconds and gigabytes to refuse: the objects are counted, and refused, first."""
    many = b"[" + b"{}," * 2_000_000 + b"{}]"
    response = await post_then_good(roomy_app, route, with_field(route, many))
    message = f"the JSON body holds more than {MAX_CONTAINERS} objects and arrays"
    assert_refused(response, ROUTES[route][0], message, 400)


async def test_brackets_inside_strings_do_not_count(roomy_app):
    text = "{[" * MAX_CONTAINERS
    body = orjson.dumps({"inputs": f"a {text}", "parameters": {"max_new_tokens": 1}})
    response = await post_then_good(roomy_app, "/invocations", body)
    assert response.status_code == 200, response.text


def test_grpc_message_over_the_limit_is_resource_exhausted(url, grpc_port):
    client = triton.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    tensor = triton.InferInput("text_input", [1], "BYTES")

    def infer(prompt: str):
        data = np.array([prompt.encode()], dtype=np.object_)
        return client.infer(MODEL, [tensor.set_data_from_numpy(data)])

    with pytest.raises(InferenceServerException) as refused:
        infer("a " * LIMIT)
    assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert [t.decode() for t in infer("a b").as_numpy("text_output")][0].startswith(" a")


def test_the_default_limit_is_sagemakers_6_mib(tmp_path):
    config = load_config(parse_args(["--model-dir", str(tmp_path)]), env={})
    assert config.max_request_size == 6 * 1024 * 1024
    env = {"SAGEMAKER_MAX_PAYLOAD_IN_MB": "20"}
    assert load_config(parse_args(["--model-dir", str(tmp_path)]), env=env) \
        .max_request_size == 20 * 1024 * 1024
