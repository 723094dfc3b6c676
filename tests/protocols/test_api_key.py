"""The optional API key, from clients' side: without it every route but health answers 401 (in
OpenAI's error shape under /v1/, the openai client's `AuthenticationError`), gRPC answers
UNAUTHENTICATED; with it (`Authorization: Bearer`, or Anthropic's `x-api-key`) everything is
served. Off by default. Where the key is set (option.api_key, --api-key, VLLM_API_KEY) and that
it is never logged."""

from __future__ import annotations

import contextlib
import logging
import queue

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton
from fakes import FakeEmbeddingEngine, FakeEngine, served_app
from server_process import free_port, serving
from test_input_limits import BODILESS, MANAGEMENT, ROUTES, post_routes, url_of
from tritonclient.utils import InferenceServerException

from handlers.config import ConfigError, load_config, log_config, parse_args
from handlers.djl.settings import check_djl_effects

KEY = "s3cret-key"
MODEL = "fake-model"
OPEN = ["/ping", "/health", "/v2/health/live", "/v2/health/ready", "/metrics", "/",
        "/openapi.json", "/docs", "/ui", "/ui/app.js"]  # the page's files ask for the key


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def app(grpc_port):
    return served_app(FakeEngine(), FakeEmbeddingEngine(), api_key=KEY, grpc_host="127.0.0.1",
                      grpc_port=grpc_port)


def chat(url: str, key: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a b"}], max_tokens=2)
    return answer.choices[0].message.content


def test_openai_client_without_the_key_gets_authentication_error(url):
    with pytest.raises(openai.AuthenticationError) as refused:
        chat(url, "not-the-key")
    assert refused.value.status_code == 401
    assert refused.value.code == "invalid_api_key"
    assert "API key" in refused.value.message


def test_openai_client_with_the_key_is_served(url):
    assert chat(url, KEY) == " <|user|> a"  # the FakeEngine echoes the rendered prompt


def test_anthropic_style_x_api_key_is_accepted(url):
    response = httpx.post(f"{url}/invocations", json={"inputs": "a b"},
                          headers={"x-api-key": KEY})
    assert response.status_code == 200


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_every_post_route_requires_the_key(url, route):
    body = ROUTES[route][1]
    refused = httpx.post(url + url_of(route), json=body)
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"] == "Bearer"
    error = refused.json()["error"]
    if route.startswith("/v1/messages"):
        assert error["type"] == "authentication_error"  # Anthropic's error object
    elif route.startswith(("/v1/", "/tokenize", "/detokenize")):
        assert error["code"] == "invalid_api_key"  # OpenAI's error object
    else:
        assert "API key" in error
    served = httpx.post(url + url_of(route), json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert served.status_code == 200


@pytest.mark.parametrize("path", ["/v1/models", "/info", "/v2", f"/v2/models/{MODEL}",
                                  f"/v2/models/{MODEL}/ready", f"/v1/models/{MODEL}", "/config"])
def test_other_get_routes_require_the_key(url, path):
    assert httpx.get(url + path).status_code == 401
    assert httpx.get(url + path, headers={"x-api-key": KEY}).status_code == 200


@pytest.mark.parametrize("path", OPEN)
def test_health_metrics_and_documents_stay_open(url, path):
    assert httpx.get(url + path).status_code == 200


def test_a_wrong_or_malformed_key_is_refused(url):
    for headers in ({"Authorization": f"Basic {KEY}"}, {"Authorization": KEY},
                    {"Authorization": f"Bearer {KEY}x"}, {"x-api-key": KEY[:-1]},
                    {"Authorization": "Bearer"}):
        assert httpx.post(f"{url}/invocations", json={"inputs": "a"},
                          headers=headers).status_code == 401, headers


def test_every_route_is_guarded_or_deliberately_open(app):
    # the POST routes tested above, and the adapter API's (test_adapter_management.py)
    assert post_routes(app) == set(ROUTES) | BODILESS | MANAGEMENT


def test_no_key_by_default():
    with serving(served_app(FakeEngine())) as url:
        assert httpx.post(f"{url}/invocations", json={"inputs": "a"}).status_code == 200


# -- gRPC ---------------------------------------------------------------------------------------


def grpc_infer(port: int, headers: dict[str, str] | None = None):
    client = triton.InferenceServerClient(f"127.0.0.1:{port}")
    tensor = triton.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([b"a b"], dtype=np.object_))
    return client.infer(MODEL, [tensor], headers=headers)


def test_grpc_without_the_key_is_unauthenticated(url, grpc_port):
    with pytest.raises(InferenceServerException) as refused:
        grpc_infer(grpc_port)
    assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as wrong:
        grpc_infer(grpc_port, {"authorization": "Bearer nope"})
    assert wrong.value.status() == "StatusCode.UNAUTHENTICATED"


@pytest.mark.parametrize("headers", [{"authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}])
def test_grpc_with_the_key_is_served(url, grpc_port, headers):
    result = grpc_infer(grpc_port, headers)
    assert result.as_numpy("text_output")[0].decode().startswith(" a b")


def test_grpc_health_stays_open_and_metadata_does_not(url, grpc_port):
    client = triton.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    assert client.is_server_live() and client.is_server_ready()
    with pytest.raises(InferenceServerException) as refused:
        client.get_model_metadata(MODEL)
    assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
    assert client.get_model_metadata(MODEL, headers={"x-api-key": KEY}).name == MODEL


def test_grpc_stream_without_the_key_is_unauthenticated(url, grpc_port):
    client = triton.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    errors: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: errors.put(error))
    try:
        tensor = triton.InferInput("text_input", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([b"a"], dtype=np.object_))
        with contextlib.suppress(InferenceServerException):  # the stream may have ended first
            client.async_stream_infer(MODEL, [tensor])
        error = errors.get(timeout=30)
    finally:
        client.stop_stream()
    assert error is not None and error.status() == "StatusCode.UNAUTHENTICATED"


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "env", "source"), [
    (["--api-key", KEY], {}, "command line --api-key"),
    (["--option", f"option.api_key={KEY}"], {}, "command line"),
    ([], {"OPTION_API_KEY": KEY}, "env OPTION_API_KEY"),
    ([], {"VLLM_API_KEY": KEY}, "env VLLM_API_KEY"),
])
def test_the_key_is_read_from_each_source_and_never_logged(tmp_path, caplog, argv, env, source):
    config = load_config(parse_args(["--model-dir", str(tmp_path), *argv]), env=env)
    assert (config.api_key, config.sources["api_key"]) == (KEY, source)
    assert KEY not in repr(config)
    with caplog.at_level(logging.INFO):
        log_config(config, logging.getLogger("test"))
    assert f"config option.api_key = <set> [{source}]" in caplog.text
    assert KEY not in caplog.text


def test_unset_by_default(tmp_path):
    assert load_config(parse_args(["--model-dir", str(tmp_path)]), env={}).api_key is None


def test_the_djl_entry_refuses_the_key_without_showing_it(tmp_path):
    """Inside DJL Serving, DJL's front end answers HTTP: the key would have no effect."""
    config = load_config(parse_args(["--model-dir", str(tmp_path), "--api-key", KEY]), env={})
    with pytest.raises(ConfigError) as refused:
        check_djl_effects(config)
    assert "option.api_key=<set> would have no effect" in str(refused.value)
    assert KEY not in str(refused.value)
