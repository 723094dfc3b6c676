"""vLLM's `/tokenize` and `/detokenize` against the shared real server on SmolLM2: text round
trips, chat messages count as the chat route counts its prompt, token strings, and errors in
OpenAI's shape."""

from __future__ import annotations

import httpx
import openai
import pytest

from handlers.protocols.tokens import MAX_IDS, MAX_TEXT

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def post(served, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{served.url}{route}", json=body, timeout=60)


def test_tokenize_then_detokenize_gives_the_text_back(served):
    text = "Héllo wörld, ça va? 🙂 1234"
    tokens = post(served, "/tokenize", {"prompt": text, "model": MODEL}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == served.context
    assert tokens["token_strs"] is None
    assert post(served, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": text}


def test_token_strings_are_the_vocabulary_s(served):
    tokens = post(served, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert tokens["token_strs"] == ["Hello", "Ġworld"]  # byte-level BPE marks a space as Ġ
    assert tokens["count"] == 2


@pytest.mark.parametrize("tools", [None, [WEATHER]])
def test_chat_messages_count_as_the_chat_route_counts_its_prompt(served, tools):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                          **({"tools": tools} if tools else {}))
    tokens = post(served, "/tokenize", {"messages": CHAT, "tools": tools}).json()
    assert tokens["count"] == chat.usage.prompt_tokens
    prompt = post(served, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n")  # the generation prompt is added
    assert "get_weather" in prompt if tools else "get_weather" not in prompt


def test_continuing_the_final_message_leaves_it_open(served):
    prefilled = [*CHAT, {"role": "assistant", "content": "The capital is"}]
    tokens = post(served, "/tokenize", {"messages": prefilled, "continue_final_message": True})
    prompt = post(served, "/detokenize", {"tokens": tokens.json()["tokens"]}).json()["prompt"]
    assert prompt.endswith("The capital is")


@pytest.mark.parametrize(("route", "body", "status", "param"), [
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": True,
                   "continue_final_message": True}, 400, "continue_final_message"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
    # Bounded as a body is: one request holds a worker for a second at most.
    ("/tokenize", {"prompt": "a" * (MAX_TEXT + 1)}, 413, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a" * MAX_TEXT}]}, 413, "messages"),
    ("/detokenize", {"tokens": [1] * (MAX_IDS + 1)}, 413, "tokens"),
])
def test_bad_requests_are_refused_in_openai_s_shape(served, route, body, status, param):
    refused = post(served, route, body)
    assert refused.status_code == status
    error = refused.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert error["type"] == "invalid_request_error"
