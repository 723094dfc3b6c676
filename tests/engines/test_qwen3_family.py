"""A tiny random Qwen3 checkpoint built here, with a Qwen3-shaped chat template (written for the
tests, tests/family_templates.py) and the thinking and tool-call tokens added to
its tokenizer: the torch engine serves it through transformers' Qwen3 class, greedy-equal to
transformers, and the server reads it as Qwen3 is served (option.reasoning_parser=qwen3,
option.tool_call_parser=hermes): tools rendered by the tokenizer's own template, thinking
switched off by chat_template_kwargs, and a JSON answer after a budgeted thinking."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from fakes import served_app
from server_process import serving
from tiny_model import make_tiny_qwen3_dir, transformers_greedy
from transformers import AutoTokenizer

from handlers.engine.torch.engine import TorchEngine
from handlers.engine.torch.loader import load_model

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_tiny_qwen3_dir(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    eng = TorchEngine(load_model(qwen3_dir, dtype="fp32"), max_batch_size=4)
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def url(engine):
    app = served_app(engine, model_name="tiny-qwen3", reasoning_parser="qwen3",
                     tool_call_parser="hermes")
    with serving(app) as base:
        yield base


def test_the_torch_engine_serves_qwen3_greedy_equal_to_transformers(engine, qwen3_dir, url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    answer = client.completions.create(model="tiny-qwen3", prompt="The weather today is",
                                       max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert answer.choices[0].text == transformers_greedy(qwen3_dir, "The weather today is", 12)


def test_tools_render_through_the_tokenizers_template_and_thinking_switches_off(qwen3_dir,
                                                                                url):
    """The prompt is what transformers' apply_chat_template makes of the tokenizer's own
    template, tools and enable_thinking included (the server's /tokenize renders it)."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    ours = httpx.post(f"{url}/tokenize", json={
        "messages": messages, "tools": TOOLS,
        "chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"]
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    assert "<tools>" in text and text.endswith("<think>\n\n</think>\n")
    assert ours == tokenizer.encode(text, add_special_tokens=False)


def test_a_json_answer_after_a_budgeted_thinking_validates(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in range(2):
        message = client.chat.completions.create(
            model="tiny-qwen3", messages=[{"role": "user", "content": "A person?"}],
            response_format=fmt, seed=seed, max_tokens=80,
            extra_body={"thinking_token_budget": 6}).choices[0].message
        jsonschema.validate(json.loads(message.content), PERSON)
