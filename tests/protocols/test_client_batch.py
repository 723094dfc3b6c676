"""One client request cannot hold the server: the sequences it asks for (its prompts, each
times max(n, best_of)) are bounded by `option.max_client_batch_size` on every route that takes
lists, refused in each protocol's own error shape before any reaches the engine, and
`job_queue_size` counts sequences, not requests. Real clients against a running server on the
FakeEngine (tests/fakes.py)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from fakes import FakeEngine, served_app
from server_process import free_port, serving
from tritonclient.utils import InferenceServerException

MODEL = "fake-model"
LIMIT = 4
SETTING = "option.max_client_batch_size"
FIVE = ["a b", "c d", "e f", "g h", "i j"]


@pytest.fixture
def server() -> Iterator[tuple[FakeEngine, str, str]]:
    """(engine, HTTP URL, gRPC address) of a server bounding requests at LIMIT sequences."""
    engine = FakeEngine()
    port = free_port()
    with serving(served_app(engine, max_client_batch_size=LIMIT, grpc_host="127.0.0.1",
                            grpc_port=port)) as url:
        yield engine, url, f"127.0.0.1:{port}"


def names_the_limit(message: str) -> bool:
    return f"at most {LIMIT}" in message and SETTING in message


def tensor(module, texts: list[str]):
    given = module.InferInput("text_input", [len(texts)], "BYTES")
    given.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    return given


def test_kserve_v2_rest_and_grpc_refuse_too_many_prompts(server):
    engine, url, address = server
    rest = triton_http.InferenceServerClient(url.removeprefix("http://"))
    with pytest.raises(InferenceServerException) as refused:
        rest.infer(MODEL, [tensor(triton_http, FIVE)])
    assert refused.value.status() == "400"
    assert "text_input[4]: 5 prompts ask for 5 sequences" in refused.value.message()
    assert names_the_limit(refused.value.message())
    remote = triton_grpc.InferenceServerClient(address)
    with pytest.raises(InferenceServerException) as refused:
        remote.infer(MODEL, [tensor(triton_grpc, FIVE)])
    assert refused.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    assert names_the_limit(refused.value.message())
    assert engine.requests == []  # refused before any prompt reached the engine
    answer = remote.infer(MODEL, [tensor(triton_grpc, FIVE[:LIMIT])],
                          parameters={"max_new_tokens": 2})
    assert len(answer.as_numpy("text_output")) == LIMIT


def test_kserve_v1_refuses_too_many_instances(server):
    engine, url, _ = server
    refused = httpx.post(f"{url}/v1/models/{MODEL}:predict", json={"instances": FIVE})
    assert refused.status_code == 400
    assert refused.json()["error"].startswith("instances[4]: 5 prompts ask for 5 sequences")
    assert names_the_limit(refused.json()["error"])
    assert engine.requests == []
    kept = httpx.post(f"{url}/v1/models/{MODEL}:predict", json={"instances": FIVE[:LIMIT]})
    assert kept.status_code == 200 and len(kept.json()["predictions"]) == LIMIT


def test_openai_and_databricks_count_prompts_times_n(server):
    engine, url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=FIVE[:3], n=2, max_tokens=2)
    error = refused.value.body
    assert error["param"] == "prompt[2]" and names_the_limit(error["message"])
    assert "3 prompts ask for 6 sequences" in error["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, n=LIMIT + 1, max_tokens=2,
                                       messages=[{"role": "user", "content": "a"}])
    assert refused.value.body["param"] == "n" and names_the_limit(refused.value.body["message"])
    databricks = httpx.post(f"{url}/serving-endpoints/{MODEL}/invocations",
                            json={"prompt": FIVE, "max_tokens": 2})
    assert databricks.status_code == 400
    assert databricks.json()["error"]["param"] == "prompt[4]"
    assert engine.requests == []
    kept = client.completions.create(model=MODEL, prompt=FIVE[:2], n=2, max_tokens=2)
    assert len(kept.choices) == LIMIT


def test_lmi_refuses_best_of_and_dynamic_batches_past_the_limit():
    with serving(served_app(FakeEngine(), max_client_batch_size=LIMIT)) as rolling:
        refused = httpx.post(f"{rolling}/invocations",
                             json={"inputs": "a b", "parameters": {"best_of": LIMIT + 1}})
    assert refused.status_code == 424 and refused.json()["code"] == 424
    assert refused.json()["error"].startswith(f"best_of: {LIMIT + 1} sequences asked for")
    assert names_the_limit(refused.json()["error"])
    engine = FakeEngine()
    with serving(served_app(engine, dynamic=(2, 1, False),
                            max_client_batch_size=LIMIT)) as dynamic:
        refused = httpx.post(f"{dynamic}/invocations", json={"inputs": FIVE})
        kept = httpx.post(f"{dynamic}/invocations", json={"inputs": FIVE[:LIMIT]})
    assert refused.status_code == 424
    assert refused.json()["error"].startswith("inputs.4: 5 prompts ask for 5 sequences")
    assert names_the_limit(refused.json()["error"])
    assert kept.status_code == 200 and len(kept.json()) == LIMIT
    assert len(engine.requests) == LIMIT  # only the request within the bound ran
