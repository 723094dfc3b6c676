"""Chat templates in the shape of five model families' (Qwen3, Llama 3, Mistral, Gemma 3,
DeepSeek-R1), written for the tests, not copied from model repositories: how each renders the
offered tools, the assistant's past calls, tool results and the thinking switch; and a
conversation that has them all (HISTORY)."""

# A past call, its result and a new question: what the templates render of a conversation.
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
