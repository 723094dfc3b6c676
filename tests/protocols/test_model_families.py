"""Five model families' chat formats, end to end through the server: each family's chat
template (written for these tests in the family's shape, not copied from a model repository)
renders the offered tools, the assistant's past calls and the tool results natively, and the
family's output (scripted, as the model would write it) comes back as OpenAI `tool_calls` and
reasoning with the parsers the family is served with (option.tool_call_parser,
option.reasoning_parser). A template that renders no tools (Gemma 3's) gets them in the system
message, in the default `<tool_call>` format."""

from __future__ import annotations

import json
from dataclasses import dataclass

import openai
import pytest
from fakes import FakeTokenizer, ScriptedEngine, served_app
from server_process import serving

MODEL = "fake-model"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": SCHEMA}}]
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Snow, -3 C"},
    {"role": "user", "content": "And in Paris?"},
]

QWEN3 = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "tool" %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{%- for call in m.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{%- if enable_thinking is defined and not enable_thinking %}
<think>

</think>
{% endif %}{% endif %}"""

LLAMA3 = """<|begin_of_text|>{%- if tools %}<|start_header_id|>system<|end_header_id|>
Environment: ipython<|eot_id|>{% endif %}
{%- for m in messages %}
{%- if loop.first and tools %}<|start_header_id|>user<|end_header_id|>
Use these functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{{ m.content }}<|eot_id|>
{%- elif m.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>
{{ m.content }}<|eot_id|>
{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>
{% for call in m.tool_calls %}{"name": "{{ call.function.name }}", "parameters": \
{{ call.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>
{{ m.content }}<|eot_id|>
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>
{% endif %}"""

MISTRAL = """<s>{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for m in messages %}
{%- if m.role == "user" %}[INST]{{ m.content }}[/INST]
{%- elif m.role == "tool" %}[TOOL_RESULTS]{"content": {{ m.content | tojson }}, \
"call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]
{%- elif m.tool_calls %}[TOOL_CALLS][{% for call in m.tool_calls %}{"name": \
"{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, "id": \
"{{ call.id }}"}{% endfor %}]</s>
{%- else %}{{ m.content }}</s>{% endif %}{%- endfor %}"""

GEMMA3 = """<bos>{%- for m in messages %}<start_of_turn>{{ "model" if m.role == "assistant" \
else m.role }}
{{ m.content }}<end_of_turn>
{% endfor %}{%- if add_generation_prompt %}<start_of_turn>model
{% endif %}"""

DEEPSEEK_R1 = """{%- for m in messages %}{%- if m.role == "user" %}<｜User｜>{{ m.content }}
{%- elif m.role == "assistant" %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>
{%- else %}{{ m.content }}{% endif %}{%- endfor %}
{%- if add_generation_prompt %}<｜Assistant｜><think>
{% endif %}"""


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
