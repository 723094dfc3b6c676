"""Reasoning parsers (handlers/protocols/chat/reasoning.py), on scripted model output, whole and
split at every point a stream may cut it: the parts always join to the same thinking and answer.
Tool calls are parsed from the answer only: a call written inside the thinking stays thinking."""

from __future__ import annotations

import json

import pytest

from handlers.config import ConfigError, load_config, parse_args
from handlers.protocols.chat.answer import AnswerParts, ChatOptions
from handlers.protocols.chat.reasoning import splitter
from handlers.protocols.chat.tool_calls import collect_calls

THOUGHT = "The user wants 2+2. That is 4."
CASES = [
    # DeepSeek-R1: the template opened the thinking; it ends at </think>
    ("deepseek_r1", f"{THOUGHT}</think>\n\nIt is 4.", THOUGHT, "\n\nIt is 4."),
    ("deepseek_r1", f"<think>{THOUGHT}</think>It is 4.", THOUGHT, "It is 4."),
    ("deepseek_r1", f"  <think>\n{THOUGHT}</think>4", f"\n{THOUGHT}", "4"),
    ("deepseek_r1", THOUGHT, THOUGHT, ""),  # never closed: all thinking (cut off, or still on)
    ("deepseek_r1", f"{THOUGHT} </thinking> no", f"{THOUGHT} </thinking> no", ""),
    # Qwen3: thinking only inside the tags the model writes
    ("qwen3", f"<think>\n{THOUGHT}\n</think>\n\nIt is 4.", f"\n{THOUGHT}\n", "\n\nIt is 4."),
    ("qwen3", f"{THOUGHT}</think>\n\nIt is 4.", "", f"{THOUGHT}</think>\n\nIt is 4."),
    ("qwen3", "It is 4.", "", "It is 4."),
    ("qwen3", "\n\n<think>\n\n</think>\n\nIt is 4.", "\n\n", "\n\nIt is 4."),
    ("qwen3", "<thin", "", "<thin"),  # the beginning of a tag, and then the end
    ("qwen3", "<think>unclosed", "unclosed", ""),
    # Granite: thinking between its two sentences
    ("granite", f"Here is my thought process:\n{THOUGHT}\nHere is my response:\nIt is 4.",
     f"\n{THOUGHT}\n", "\nIt is 4."),
    ("granite", f"Here's my thought process: {THOUGHT} Here's my response: 4", f" {THOUGHT} ",
     " 4"),
    ("granite", "It is 4.", "", "It is 4."),
    ("granite", "Here is my", "", "Here is my"),
]


def split(name: str, pieces: list[str]) -> tuple[str, str]:
    parser = splitter(name)
    reasoning, content = "", ""
    for piece in pieces:
        out = parser.feed(piece)
        reasoning, content = reasoning + out.reasoning, content + out.content
    out = parser.finish()
    return reasoning + out.reasoning, content + out.content


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_every_split_of_the_stream_gives_the_same_parts(name, text, reasoning, content):
    assert split(name, [text]) == (reasoning, content)
    assert split(name, list(text)) == (reasoning, content)  # a character at a time
    for cut in range(1, len(text)):
        assert split(name, [text[:cut], text[cut:]]) == (reasoning, content), cut
    for first in range(1, len(text), 3):
        for second in range(first + 1, len(text), 5):
            pieces = [text[:first], text[first:second], text[second:]]
            assert split(name, pieces) == (reasoning, content), (first, second)


TOOLS = {"get_weather"}


def parts(text: str, pieces: int = 1) -> tuple[str, str, list]:
    """The text through a chat answer's parts (deepseek_r1, tools offered, tool_choice auto),
    fed whole or a character at a time."""
    answer = AnswerParts(ChatOptions(tool_mode="auto", tool_names=frozenset(TOOLS),
                                     reasoning_parser="deepseek_r1"))
    if pieces == 1:
        return answer.whole(text)
    reasoning, content, calls = "", "", []
    for char in text:
        r, c, k = answer.feed(char)
        reasoning, content, calls = reasoning + r, content + c, calls + k
    r, c, k = answer.finish()
    return reasoning + r, content + c, collect_calls(calls + k)


def call(arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": arguments},
                                        ensure_ascii=False) + "\n</tool_call>"


@pytest.mark.parametrize("pieces", [1, 0])
def test_a_tool_call_inside_the_thinking_stays_thinking(pieces):
    thinking = f"Maybe {call({'city': 'Oslo'})} would do."
    reasoning, content, calls = parts(f"{thinking}</think>{call({'city': 'Paris'})}", pieces)
    assert reasoning == thinking and content == ""
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}]


@pytest.mark.parametrize("pieces", [1, 0])
def test_two_calls_with_nested_json_and_unicode(pieces):
    first = {"city": "Zürich", "when": {"day": "今日", "hours": [9, 17]}}
    second = {"city": "Kraków ☂", "options": {"units": {"temp": "C"}}}
    reasoning, content, calls = parts(f"Two cities.</think>{call(first)}\n{call(second)}",
                                      pieces)
    assert reasoning == "Two cities." and not content.strip()
    assert [json.loads(c.arguments) for c in calls] == [first, second]


@pytest.mark.parametrize("pieces", [1, 0])
def test_a_call_cut_off_after_the_thinking_keeps_what_was_written(pieces):
    text = 'Done.</think><tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    reasoning, content, calls = parts(text, pieces)
    assert (reasoning, content) == ("Done.", "")
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Pa')]


def test_an_unknown_parser_stops_startup_naming_the_key_and_the_names(tmp_path):
    argv = ["--model-dir", str(tmp_path), "--option", "option.reasoning_parser=deepseek"]
    with pytest.raises(ConfigError, match=r"option.reasoning_parser.*deepseek_r1, qwen3, granite"):
        load_config(parse_args(argv), env={})
    argv[-1] = "option.reasoning_parser=qwen3"
    assert load_config(parse_args(argv), env={}).reasoning_parser == "qwen3"
