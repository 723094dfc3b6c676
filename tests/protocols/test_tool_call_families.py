"""Each family's tool calls (option.tool_call_parser) arrive as OpenAI `tool_calls` whose
arguments validate against the tool's schema, whole and streamed, with the openai SDK, on
scripted engine output in the family's format; Anthropic's `tool_use` blocks read the same."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from fakes import ScriptedEngine, served_app
from server_process import serving

MODEL = "fake-model"
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"},
    "days": {"type": "array", "items": {"type": "string"}}}, "required": ["city"],
    "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
ARGUMENTS = [{"city": "Paris", "days": ["lundi"]}, {"city": "Kraków ☂"}]
FAMILIES = {
    "hermes": "".join(f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(a)}}}'
                      "\n</tool_call>\n" for a in ARGUMENTS),
    "llama3_json": "<|python_tag|>" + "; ".join(
        json.dumps({"name": "get_weather", "parameters": a}) for a in ARGUMENTS),
    "mistral": "[TOOL_CALLS]" + json.dumps([{"name": "get_weather", "arguments": a}
                                            for a in ARGUMENTS]),
    "pythonic": "[get_weather(city='Paris', days=['lundi']), get_weather(city='Kraków ☂')]",
}
CHAT = [{"role": "user", "content": "Weather in Paris and Kraków?"}]


def pieces(text: str, size: int = 7) -> tuple[str, ...]:
    return tuple(text[i:i + size] for i in range(0, len(text), size))


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    engine = ScriptedEngine(script=pieces(FAMILIES[request.param]), max_model_len=4096)
    with serving(served_app(engine, tool_call_parser=request.param)) as url:
        yield url


def test_calls_arrive_as_tool_calls_that_validate_whole_and_streamed(family, request):
    family_name = request.node.callspec.params["family"]
    client = openai.OpenAI(base_url=f"{family}/v1", api_key="x", max_retries=0)
    choice = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    arguments = [json.loads(call.function.arguments) for call in choice.message.tool_calls]
    assert arguments == ARGUMENTS
    for value in arguments:
        jsonschema.validate(value, SCHEMA)
    deltas = [chunk.choices[0].delta for chunk in client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=TOOLS, stream=True) if chunk.choices]
    streamed = [call for delta in deltas for call in delta.tool_calls or []]
    firsts = [call for call in streamed if call.id]  # a call's first delta: id and name
    assert [(c.index, c.function.name) for c in firsts] == [(0, "get_weather"),
                                                            (1, "get_weather")]
    assert all(c.function.name is None for c in streamed if not c.id)  # the name once
    if family_name != "pythonic":  # JSON arguments come in pieces as they are generated
        assert len(streamed) > 4
    joined = ["".join(c.function.arguments or "" for c in streamed if c.index == index)
              for index in (0, 1)]
    assert [json.loads(arguments) for arguments in joined] == ARGUMENTS
    assert not "".join(d.content or "" for d in deltas).strip()


def test_anthropic_reads_the_same_calls_as_tool_use_blocks(family):
    claude = anthropic.Anthropic(base_url=family, api_key="x", max_retries=0)
    tools = [{"name": "get_weather", "input_schema": SCHEMA}]
    message = claude.messages.create(model=MODEL, max_tokens=512, messages=CHAT, tools=tools)
    assert message.stop_reason == "tool_use"
    assert [block.input for block in message.content if block.type == "tool_use"] == ARGUMENTS
    with claude.messages.stream(model=MODEL, max_tokens=512, messages=CHAT,
                                tools=tools) as stream:
        pieces = [event.partial_json for event in stream if event.type == "input_json"]
        streamed = stream.get_final_message()
    assert [block.input for block in streamed.content if block.type == "tool_use"] == ARGUMENTS
    assert len(pieces) >= 2


def test_the_responses_api_streams_the_same_calls(family):
    client = openai.OpenAI(base_url=f"{family}/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
    with client.responses.stream(model=MODEL, input="Weather in Paris and Kraków?",
                                 tools=tools) as stream:
        deltas = [e for e in stream if e.type == "response.function_call_arguments.delta"]
        response = stream.get_final_response()
    calls = [item for item in response.output if item.type == "function_call"]
    assert [json.loads(call.arguments) for call in calls] == ARGUMENTS
    assert {call.status for call in calls} == {"completed"} and len(deltas) >= 2
