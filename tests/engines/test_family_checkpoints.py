"""Tiny random checkpoints of four families built here, each with its family's architecture,
chat template (tests/family_templates.py, written for the tests) and tokens: Llama 3
(LlamaForCausalLM), Mistral (MistralForCausalLM), Gemma 3 (Gemma3ForCausalLM) and a
DeepSeek-R1 distill (Qwen2ForCausalLM), served by the torch engine with the family's parsers.
The prompt is what transformers' apply_chat_template makes of the tokenizer's own template
(tools, past calls and results included), the engine is greedy-equal to transformers on the
architecture, and a forced call (constrained) arrives as `tool_calls` whose arguments validate
against the tool's schema, after the thinking for the reasoning model. (Qwen3's checkpoint:
test_qwen3_family.py; the families' parsers on scripted output: test_model_families.py.)"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch
from fakes import served_app
from family_templates import DEEPSEEK_R1, GEMMA3, HISTORY, LLAMA3, MISTRAL
from server_process import serving
from tiny_model import transformers_greedy
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from handlers.engine.gguf.cache import cached_gguf_dir
from handlers.engine.torch.engine import TorchEngine
from handlers.engine.torch.loader import load_model
from handlers.model_source import default_model_path


@dataclass(frozen=True)
class Family:
    config: type
    template: str
    tokens: tuple[str, ...]  # the family's own, added to the tokenizer
    settings: dict[str, str]
    renders_tools: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # more of the config


FAMILIES = {
    "llama3": Family(LlamaConfig, LLAMA3, ("<|begin_of_text|>", "<|start_header_id|>",
                                           "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"),
                     {"tool_call_parser": "llama3_json"}),
    "mistral": Family(MistralConfig, MISTRAL, ("<s>", "</s>", "[INST]", "[/INST]",
                                               "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                                               "[TOOL_CALLS]", "[TOOL_RESULTS]",
                                               "[/TOOL_RESULTS]"),
                      {"tool_call_parser": "mistral"}),
    "gemma3": Family(Gemma3TextConfig, GEMMA3, ("<bos>", "<start_of_turn>", "<end_of_turn>"),
                     {}, renders_tools=False, extra={"head_dim": 16}),
    "deepseek_r1": Family(Qwen2Config, DEEPSEEK_R1, ("<｜User｜>", "<｜Assistant｜>",
                                                     "<｜end▁of▁sentence｜>", "<think>",
                                                     "</think>"),
                          {"reasoning_parser": "deepseek_r1"}, renders_tools=False),
}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
          "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]


def build(folder, fam: Family):
    tokenizer = AutoTokenizer.from_pretrained(cached_gguf_dir(default_model_path()))
    tokenizer.add_tokens(list(fam.tokens))
    tokenizer.chat_template = fam.template
    config = fam.config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=1024, tie_word_embeddings=True,
                        eos_token_id=tokenizer.eos_token_id, **fam.extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    fam = FAMILIES[request.param]
    folder = build(tmp_path_factory.mktemp(request.param), fam)
    engine = TorchEngine(load_model(folder, dtype="fp32"), max_batch_size=4)
    asyncio.run(engine.start())
    try:
        with serving(served_app(engine, model_name=request.param, **fam.settings)) as url:
            yield request.param, fam, folder, url
    finally:
        asyncio.run(engine.shutdown())


def test_the_prompt_is_the_tokenizers_own_rendering(family):
    name, fam, folder, url = family
    tools = TOOLS if fam.renders_tools else None
    history = HISTORY if fam.renders_tools else [HISTORY[0]]
    ours = httpx.post(f"{url}/tokenize", json={"messages": history, "tools": tools},
                      timeout=60).json()["tokens"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template(_as_templates_read(history), tools=tools,
                                         tokenize=False, add_generation_prompt=True)
    assert ours == tokenizer.encode(text, add_special_tokens=False)


def _as_templates_read(messages: list[dict]) -> list[dict]:
    """A past call's arguments as an object, as vLLM gives them to chat templates (the
    families' templates write them with `tojson`)."""
    def call(c: dict) -> dict:
        return {**c, "function": {**c["function"],
                                  "arguments": json.loads(c["function"]["arguments"])}}
    return [{**m, "tool_calls": [call(c) for c in m["tool_calls"]]} if m.get("tool_calls")
            else m for m in messages]


def test_the_engine_is_greedy_equal_to_transformers(family):
    name, _, folder, url = family
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    answer = client.completions.create(model=name, prompt="The weather today is",
                                       max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert answer.choices[0].text == transformers_greedy(folder, "The weather today is", 8)


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_call_validates_against_the_tools_schema(family, choice):
    name, fam, _, url = family
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    forced = {"type": "function", "function": {"name": "get_weather"}} \
        if choice == "named" else "required"
    budget = {"thinking_token_budget": 4} if "reasoning_parser" in fam.settings else {}
    for seed in range(2):  # one call: a random model would go on calling up to the cap
        choice_ = client.chat.completions.create(
            model=name, messages=HISTORY, tools=TOOLS, tool_choice=forced, seed=seed,
            max_tokens=120, parallel_tool_calls=False, extra_body=budget).choices[0]
        assert choice_.finish_reason in ("tool_calls", "stop"), choice_
        assert choice_.message.tool_calls, choice_.message
        for call in choice_.message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
