"""Five model families' chat formats, end to end through the server: each family's chat template
(written for these tests in the family's shape, not copied from a model repository) renders the
offered tools, the assistant's past calls and the tool results natively, and the family's output
(scripted, as the model would write it; the templates: tests/family_templates.py) comes back as
OpenAI `tool_calls` and reasoning with the parsers the family is served with
(option.tool_call_parser, option.reasoning_parser). A template that renders no tools (Gemma 3's)
gets them in the system message, in the default `<tool_call>` format."""

from __future__ import annotations

import json
from dataclasses import dataclass

import openai
import pytest
from fakes import FakeTokenizer, ScriptedEngine, served_app
from family_templates import DEEPSEEK_R1, GEMMA3, HISTORY, LLAMA3, MISTRAL, QWEN3
from server_process import serving

MODEL = "fake-model"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": SCHEMA}}]

@dataclass(frozen=True)
class Family:
    template: str
    settings: dict[str, str]
    output: str  # what the model writes: a call to get_weather for Paris
    rendered: tuple[str, ...]  # what the prompt shows of the tools, the past call, the result
    reasoning: str | None = None


CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
FAMILIES = {
    "qwen3": Family(QWEN3, {"tool_call_parser": "hermes", "reasoning_parser": "qwen3"},
                    "<think>\nParis, then.\n</think>\n\n<tool_call>\n" + json.dumps(CALL)
                    + "\n</tool_call>",
                    ("<tools>", '"name": "get_weather"', "<tool_call>",
                     "<tool_response>\nSnow, -3 C"), reasoning="\nParis, then.\n"),
    "llama3": Family(LLAMA3, {"tool_call_parser": "llama3_json"},
                     json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}}),
                     ("Environment: ipython", "Use these functions:", '"parameters"',
                      "ipython<|end_header_id|>\nSnow, -3 C")),
    "mistral": Family(MISTRAL, {"tool_call_parser": "mistral"},
                      "[TOOL_CALLS]" + json.dumps([CALL]),
                      ("[AVAILABLE_TOOLS]", "[TOOL_CALLS][", "[TOOL_RESULTS]")),
    "gemma3": Family(GEMMA3, {}, "<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>",
                     ("<start_of_turn>system\nYou can call functions", "<tools>",
                      "<tool_call>")),
    "deepseek_r1": Family(DEEPSEEK_R1, {"reasoning_parser": "deepseek_r1"},
                          "The user asks for Paris.</think>\n\nIt is sunny.",
                          ("<｜Assistant｜><think>",), reasoning="The user asks for Paris."),
}


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    fam = FAMILIES[request.param]
    engine = ScriptedEngine(script=tuple(fam.output[i:i + 5] for i in range(0, len(fam.output),
                                                                             5)),
                            max_model_len=4096, tokenizer=FakeTokenizer(fam.template))
    with serving(served_app(engine, **fam.settings)) as url:
        yield request.param, fam, engine, url


def test_each_family_renders_tools_and_reads_its_answer(family):
    name, fam, engine, url = family
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    tools = TOOLS if name != "deepseek_r1" else None  # its template renders no tools
    message = client.chat.completions.create(model=MODEL, messages=HISTORY,
                                             tools=tools).choices[0].message
    prompt = engine.requests[-1].prompt
    for shown in fam.rendered:
        assert shown in prompt, (name, shown, prompt)
    if name != "gemma3":  # the generic tool prompt only where the template renders no tools
        assert "You can call functions" not in prompt
    assert message.model_extra.get("reasoning_content") == fam.reasoning
    if tools:
        assert [json.loads(call.function.arguments) for call in message.tool_calls] == [
            {"city": "Paris"}]
    else:
        assert message.content == "\n\nIt is sunny." and not message.tool_calls
