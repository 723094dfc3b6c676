"""The official `openai` client against the real server on the real SmolLM2 (one server), and
against the FakeEngine for client disconnects."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
from served_models import float32_where_torch_serves
from server_process import running_server

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with running_server(*float32_where_torch_serves(), log_path=log) as server_url:
        yield server_url  # its answers are compared with words: see served_models.py


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, **fields):
    return client.chat.completions.create(**{"model": MODEL, "messages": CAPITAL,
                                             "temperature": 0, "max_tokens": 8, **fields})


def test_models_lists_the_served_models_in_both_shapes(client, url):
    served = [MODEL, "all-minilm-l6-v2"]  # the LLM and the default embedding model
    assert [m.id for m in client.models.list()] == served
    assert requests.get(f"{url}/v1/models", timeout=10).json()["models"] == served


@pytest.fixture(scope="module")
def capital(client):
    """One greedy answer several tests compare against."""
    return chat(client)


def test_chat_completion(capital):
    answer = capital
    choice = answer.choices[0]
    assert answer.object == "chat.completion" and answer.model == MODEL
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = answer.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 < usage.completion_tokens <= 8
    extra = answer.model_extra  # MindIE's timings
    assert extra["prefill_time"] > 0
    assert len(extra["decode_time_arr"]) == usage.completion_tokens - 1


def test_streamed_chat_matches_the_whole_answer_and_ends_with_usage(client, capital):
    whole = capital
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n2_with_logprobs(client):
    answer = chat(client, n=2, temperature=1.0, seed=3, max_tokens=4, logprobs=True,
                  top_logprobs=3)
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in answer.choices)
    for choice in answer.choices:
        for entry in choice.logprobs.content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
            assert entry.bytes == list(entry.token.encode())
        assert "".join(e.token for e in choice.logprobs.content) == choice.message.content


def test_completion_with_echo_logprobs_and_max_tokens(client):
    prompt = "The capital of France is"
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                       echo=True, logprobs=2)
    choice = answer.choices[0]
    assert answer.object == "text_completion" and choice.text.startswith(prompt + " Paris")
    assert choice.finish_reason == "length" and answer.usage.completion_tokens == 3
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == answer.usage.prompt_tokens + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(len(top) >= 2 for top in logprobs.top_logprobs[-3:])
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_stop_string_ends_the_completion(client):
    answer = client.completions.create(model=MODEL, prompt="The capital of France is",
                                       max_tokens=8, temperature=0, stop=["."])
    assert answer.choices[0].text == " Paris"
    assert answer.choices[0].finish_reason == "stop"


def test_streamed_completion_with_two_prompts(client):
    chunks = list(client.completions.create(
        model=MODEL, prompt=["The capital of France is", "One, two,"], max_tokens=4,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts[0].startswith(" Paris") and "three" in texts[1]
    assert chunks[-1].usage.completion_tokens == 8


def test_a_prefilled_answer_is_continued_and_echoed(client):
    prefix = "The capital of France is"
    answer = chat(client, messages=[*CAPITAL, {"role": "assistant", "content": prefix}],
                  extra_body={"continue_final_message": True, "echo": True})
    content = answer.choices[0].message.content
    assert content.startswith(prefix + " ") and "Paris" in content  # continued, not restarted
    assert answer.usage.completion_tokens <= 8


def test_a_chat_offered_a_tool(client, capital):
    variants = [{"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "none"}]
    with ThreadPoolExecutor(2) as pool:  # batched together: one decode pass for both
        offered, hidden = pool.map(lambda v: chat(client, max_tokens=4, **v), variants)
    plain = capital
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens  # the tool is in the prompt
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens
    choice = offered.choices[0]
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls[0].function.name == "get_weather"
    else:
        assert choice.message.content and not choice.message.tool_calls


@pytest.mark.parametrize(("fields", "param"), [
    ({"temperature": 3}, "temperature"),
    ({"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    ({"messages": [*CAPITAL, {"role": "system", "content": "late"}]}, "messages[1].role"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 10**6}, "max_tokens"),
])
def test_bad_chat_requests_raise_bad_request_with_the_param(client, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, **fields)
    assert info.value.status_code == 400 and info.value.param == param


def test_suffix_and_unknown_model(client):
    completion = client.completions.create(model=MODEL, prompt="def f():", suffix="\n# done",
                                           max_tokens=4, temperature=0)
    assert completion.choices[0].text.endswith("\n# done")
    with pytest.raises(openai.NotFoundError) as info:
        chat(client, model="gpt-4o")
    assert info.value.code == "model_not_found"


def test_invocations_routes_by_body(url):
    def invoke(body):
        return requests.post(f"{url}/invocations", json=body, timeout=60).json()

    assert invoke({"messages": CAPITAL, "max_tokens": 1})["object"] == "chat.completion"
    assert invoke({"prompt": "Hi", "max_tokens": 1})["object"] == "text_completion"
    assert "generated_text" in invoke({"inputs": "Hi", "parameters": {"max_new_tokens": 1}})
    error = invoke({"prompt": "Hi", "temperature": -1})["error"]
    assert error["param"] == "temperature"


# -- disconnects, with the FakeEngine behind a real socket ----------------------------------------

async def test_hanging_up_a_stream_aborts_every_prompt(live_fake):
    engine, base = live_fake
    body = {"prompt": ["a b", "c d"], "max_tokens": 50, "stream": True}
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client:
        stream = await client.completions.create(model="fake-model", **body)
        first = await anext(aiter(stream))
        await stream.close()
    assert first.choices[0].text in (" a", " c")
    ids = {r.request_id for r in engine.requests}
    assert len(ids) == 2
    await engine.until(lambda: ids <= set(engine.aborted))  # both prompts, not just the one read


@pytest.mark.parametrize("stream", [False, True])
async def test_hanging_up_before_the_answer_aborts(live_fake, stream):
    engine, base = live_fake
    content = "a b [[stall:0]]"  # the engine yields nothing: only the hang-up can end it
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client:
        pending = asyncio.create_task(client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": content}], max_tokens=50,
            stream=stream))
        await engine.until(lambda: bool(engine.requests))
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
    rid = engine.requests[-1].request_id
    await engine.until(lambda: rid in engine.aborted)
    assert engine.generated[rid] == 0  # aborted before any token
