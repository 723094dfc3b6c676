"""Tool-call parsers per model family (handlers/protocols/chat/tool_parsers.py), on each
family's call format (written for these tests), whole and split at every point a stream may cut
it: the calls and the content are the same. The failure cases users report: a truncated call,
two calls in one answer, nested JSON and unicode in the arguments, a function not offered, and
(with a reasoning parser) a call written inside the thinking."""

from __future__ import annotations

import json

import pytest

from handlers.protocols.chat.answer import AnswerParts, ChatFormat, ChatOptions
from handlers.protocols.chat.requests import ChatCompletionRequest

NAMES = frozenset({"get_weather", "search"})
PARIS = {"city": "Paris"}
NESTED = {"city": "Zürich ☂", "when": {"days": ["今日", "明日"], "hours": [9, 17]},
          "note": 'say "hi"'}


def hermes(name: str, arguments: dict) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def llama3(name: str, arguments: dict) -> str:
    return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


def mistral(*calls: tuple[str, dict]) -> str:
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls],
                                       ensure_ascii=False)


def pythonic(*calls: tuple[str, dict]) -> str:
    def one(name: str, arguments: dict) -> str:
        return f"{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"
    return "[" + ", ".join(one(n, a) for n, a in calls) + "]"


# (parser, output, content, calls)
CASES = [
    ("hermes", "Let me check.\n" + hermes("get_weather", PARIS), "Let me check.\n",
     [("get_weather", PARIS)]),
    ("hermes", hermes("get_weather", PARIS) + "\n" + hermes("search", NESTED), "\n",
     [("get_weather", PARIS), ("search", NESTED)]),
    ("llama3_json", llama3("get_weather", PARIS), "", [("get_weather", PARIS)]),
    ("llama3_json", "<|python_tag|>" + llama3("get_weather", PARIS) + "; "
     + llama3("search", NESTED), "", [("get_weather", PARIS), ("search", NESTED)]),
    ("llama3_json", "It is sunny in Paris.", "It is sunny in Paris.", []),
    ("mistral", mistral(("get_weather", PARIS), ("search", NESTED)), "",
     [("get_weather", PARIS), ("search", NESTED)]),
    ("mistral", "Sure. " + mistral(("get_weather", PARIS)), "Sure. ", [("get_weather", PARIS)]),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "",
     [("get_weather", PARIS)]),  # the marker skipped as a special token
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [("get_weather", PARIS)]),
    ("pythonic", pythonic(("get_weather", PARIS), ("search", NESTED)), "",
     [("get_weather", PARIS), ("search", NESTED)]),
    ("pythonic", "<|python_start|>" + pythonic(("get_weather", PARIS)) + "<|python_end|>", "",
     [("get_weather", PARIS)]),
    ("pythonic", "[1, 2, 3] are numbers.", "[1, 2, 3] are numbers.", []),
]
TRUNCATED = [
    ("hermes", hermes("get_weather", PARIS)[:-20]),
    ("llama3_json", llama3("get_weather", PARIS)[:-3]),
    ("mistral", mistral(("get_weather", PARIS))[:-4]),
    ("pythonic", pythonic(("get_weather", PARIS))[:-2]),
]
UNKNOWN = [("hermes", hermes("launch", PARIS)), ("llama3_json", llama3("launch", PARIS)),
           ("mistral", mistral(("launch", PARIS))), ("pythonic", pythonic(("launch", PARIS)))]


def options(parser: str, reasoning: str | None = None, parallel: bool = True) -> ChatOptions:
    return ChatOptions(tool_mode="auto", tool_names=NAMES, tool_parser=parser,
                       reasoning_parser=reasoning, parallel_calls=parallel)


def run(opts: ChatOptions, pieces: list[str]) -> tuple[str, str, list[tuple[str, dict]]]:
    parts = AnswerParts(opts)
    reasoning, content, calls = "", "", []
    for piece in pieces:
        r, c, k = parts.feed(piece)
        reasoning, content, calls = reasoning + r, content + c, calls + k
    r, c, k = parts.finish()
    calls += k
    return reasoning + r, content + c, [(call.name, json.loads(call.arguments)) for call in calls]


def splits(text: str) -> list[list[str]]:
    """The text whole, a character at a time, and cut in two at every point."""
    return [[text], list(text), *([text[:cut], text[cut:]] for cut in range(1, len(text)))]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_each_familys_calls_at_every_split_of_the_stream(parser, text, content, calls):
    for pieces in splits(text):
        assert run(options(parser), pieces) == ("", content, calls), pieces


@pytest.mark.parametrize(("parser", "text"), TRUNCATED + UNKNOWN)
def test_a_truncated_call_or_an_unknown_function_stays_text(parser, text):
    for pieces in splits(text):
        assert run(options(parser), pieces) == ("", text, [])


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_a_call_inside_the_thinking_stays_thinking(parser):
    write = {"hermes": lambda: hermes("get_weather", PARIS),
             "llama3_json": lambda: llama3("get_weather", PARIS),
             "mistral": lambda: mistral(("get_weather", PARIS)),
             "pythonic": lambda: pythonic(("get_weather", PARIS))}[parser]
    thinking = f"I could call {write()} maybe."
    text = f"{thinking}</think>{write()}"
    for pieces in splits(text):
        assert run(options(parser, "deepseek_r1"), pieces) == (
            thinking, "", [("get_weather", PARIS)])


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = hermes("get_weather", PARIS) + hermes("search", NESTED)
    for pieces in splits(text):
        assert run(options("hermes", parallel=False), pieces)[2] == [("get_weather", PARIS)]


def test_mistral_calls_get_mistrals_ids():
    parts = AnswerParts(options("mistral"))
    _, _, calls = parts.whole(mistral(("get_weather", PARIS)))
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


def test_auto_tool_choice_switched_off_is_refused():
    request = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto",
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]})
    with pytest.raises(Exception, match="tool_choice: 'auto' is off"):
        ChatOptions.for_request(request, ChatFormat(auto_tool_choice=False))
    assert ChatOptions.for_request(request).tool_mode == "auto"
