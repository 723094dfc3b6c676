"""Too long a prompt costs what the context bounds, not what the client sends: against the shared
real server (SmolLM2, a 256-token context), a 5 MB prompt is refused on every route that
tokenizes one, in the route's own error shape naming the context, while the server's peak
memory grows by less than tokenizing it would take (a 5 MB prompt took ~500 MB); the longest
prompt that fits (the longest token, repeated) and a chat just inside the context still answer.

Peak memory is the kernel's high-water mark of the server's resident set (VmHWM), reset before
each request through /proc/PID/clear_refs: a count, not a clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from handlers.engine.gguf.cache import cached_tokenizer
from handlers.model_source import default_model_path

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
EMBEDDER = "all-minilm-l6-v2"
BIG = "The quick brown fox jumps over the lazy dog, and then it rests. " * 78_125  # 5 MB
# The server's peak may grow by this while it reads, checks and refuses a 5 MB prompt: its body
# and the strings made of it. Tokenizing it whole grew it by ~500 MB.
PEAK_GROWTH = 100 << 20
CHAT = {"messages": [{"role": "user", "content": BIG}], "max_tokens": 1}


def _context(served: Any) -> str:
    return f"context is {served.context} tokens"


# Each route that tokenizes a prompt: its body, status and the error's text.
ROUTES = {
    "/v1/chat/completions": (CHAT, 400, lambda body: body["error"]["message"]),
    "/v1/completions": ({"prompt": BIG, "max_tokens": 1}, 400,
                        lambda body: body["error"]["message"]),
    "/v1/responses": ({"input": BIG, "max_output_tokens": 16}, 400,
                      lambda body: body["error"]["message"]),
    "/invocations": ({"inputs": BIG, "parameters": {"max_new_tokens": 1}}, 424,
                     lambda body: body["error"]),
    "/generate": ({"inputs": BIG, "parameters": {"max_new_tokens": 1}}, 422,
                  lambda body: body["error"]),
    f"/v2/models/{MODEL}/generate": ({"text_input": BIG, "parameters": {"max_tokens": 1}}, 400,
                                     lambda body: body["error"]),
    "/v1/messages": ({**CHAT, "model": MODEL}, 400, lambda body: body["error"]["message"]),
    "/v1/messages/count_tokens": ({"messages": CHAT["messages"], "model": MODEL}, 400,
                                  lambda body: body["error"]["message"]),
}


def peak_growth(pid: int, send: Any) -> tuple[int, Any]:
    """How far the process's peak resident set grew above its resident set while `send()` ran
    (bytes), and what `send()` returned."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak is now the present
    before = _vm(pid, "VmHWM")
    answer = send()
    return _vm(pid, "VmHWM") - before, answer


def _vm(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no {name} in /proc/{pid}/status")


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_5_mb_prompt_is_refused_naming_the_context_at_a_bounded_cost(served, route):
    body, status, message = ROUTES[route]
    growth, answer = peak_growth(served.pid, lambda: httpx.post(f"{served.url}{route}", json=body,
                                                                timeout=120))
    assert answer.status_code == status, answer.text[:500]
    assert _context(served) in message(answer.json())
    assert growth < PEAK_GROWTH, f"the peak grew by {growth >> 20} MiB"


def test_the_openai_client_gets_a_context_length_error(served):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, **CHAT)
    assert refused.value.code == "context_length_exceeded"
    assert _context(served) in refused.value.message


def test_the_longest_prompt_that_fits_still_answers(served):
    """The bound's worst case: the vocabulary's longest token, once per token of the context
    but one, is exactly as many bytes as the bound lets through, and it fits."""
    tokenizer = cached_tokenizer(default_model_path())
    spelled = sorted(tokenizer.get_vocab().items(), key=lambda item: -len(item[0]))[:20]
    alone = [text for text in (tokenizer.decode([i]) for _, i in spelled)
             if len(tokenizer.encode(text, add_special_tokens=False)) == 1]
    longest = max(alone, key=lambda text: len(text.encode()))
    prompt = longest * (served.context - 1)
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert answer.usage.prompt_tokens == served.context - 1
    assert answer.usage.completion_tokens == 1
    over = httpx.post(f"{served.url}/v1/completions", timeout=60,
                      json={"prompt": prompt + longest, "max_tokens": 1})
    assert over.status_code == 400 and _context(served) in over.json()["error"]["message"]


def test_a_chat_just_inside_the_context_answers(served):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)
    counted = httpx.post(f"{served.url}/tokenize", timeout=60, json={
        "messages": [{"role": "user", "content": "word " * 200}]}).json()["count"]
    content = "word " * (200 + served.context - 1 - counted)  # one token short of the context
    answer = client.chat.completions.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": content}])
    assert answer.usage.prompt_tokens == served.context - 1
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, max_tokens=1,
                                       messages=[{"role": "user", "content": content + "word "}])


def test_count_tokens_refuses_a_prompt_past_the_context_as_anthropic_does(served):
    client = anthropic.Anthropic(base_url=served.url, api_key="none", max_retries=0)
    inside = [{"role": "user", "content": "word " * 100}]
    assert client.messages.count_tokens(model=MODEL, messages=inside).input_tokens < served.context
    past = [{"role": "user", "content": "word " * 300}]  # no bound by bytes: counted
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.count_tokens(model=MODEL, messages=past)
    assert f"tokens > {served.context - 1} maximum" in refused.value.message


def test_a_5_mb_embeddings_input_is_read_only_as_far_as_the_model_reads(served):
    """The embedding model reads an input's first 256 tokens (longer inputs are truncated, as
    sentence-transformers truncates them): a 5 MB input costs what those do."""
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)
    client.embeddings.create(model=EMBEDDER, input="loaded before the peak is measured")
    growth, answer = peak_growth(served.pid, lambda: client.embeddings.create(model=EMBEDDER,
                                                                               input=BIG))
    assert answer.usage.prompt_tokens == 256
    assert growth < PEAK_GROWTH, f"the peak grew by {growth >> 20} MiB"
