"""Tool-call parsers per model family (handlers/protocols/chat/tool_parsers/), on each
family's call format (written for these tests), whole and split at every point a stream may cut
it: the calls and the content are the same. The failure cases users report: a truncated call,
two calls in one answer, nested JSON and unicode in the arguments, a function not offered, and
(with a reasoning parser) a call written inside the thinking."""

from __future__ import annotations

import json

import pytest

from handlers.protocols.chat.answer import AnswerParts, ChatFormat, ChatOptions
from handlers.protocols.chat.requests import ChatCompletionRequest
from handlers.protocols.chat.tool_calls import CallDelta, collect_calls

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
# cut off before the call's name was read, or (pythonic) before its call closed
CUT_EARLY = [
    ("hermes", hermes("get_weather", PARIS)[:22]),
    ("llama3_json", llama3("get_weather", PARIS)[:14]),
    ("mistral", mistral(("get_weather", PARIS))[:25]),
    ("pythonic", pythonic(("get_weather", PARIS))[:-2]),
]
# cut off inside the arguments: the call started, and keeps what was written of them
CUT_IN_ARGUMENTS = [
    ("hermes", hermes("get_weather", PARIS)[:-20]),
    ("llama3_json", llama3("get_weather", PARIS)[:-3]),
    ("mistral", mistral(("get_weather", PARIS))[:-4]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par'),
]
UNKNOWN = [("hermes", hermes("launch", PARIS)), ("llama3_json", llama3("launch", PARIS)),
           ("mistral", mistral(("launch", PARIS))), ("pythonic", pythonic(("launch", PARIS)))]


def options(parser: str, reasoning: str | None = None, parallel: bool = True) -> ChatOptions:
    return ChatOptions(tool_mode="auto", tool_names=NAMES, tool_parser=parser,
                       reasoning_parser=reasoning, parallel_calls=parallel)


def deltas_of(opts: ChatOptions, pieces: list[str]) -> tuple[str, str, list[CallDelta]]:
    parts = AnswerParts(opts)
    reasoning, content, deltas = "", "", []
    for piece in pieces:
        r, c, k = parts.feed(piece)
        reasoning, content, deltas = reasoning + r, content + c, deltas + k
    r, c, k = parts.finish()
    return reasoning + r, content + c, deltas + k


def run(opts: ChatOptions, pieces: list[str]) -> tuple[str, str, list[tuple[str, dict]]]:
    reasoning, content, deltas = deltas_of(opts, pieces)
    calls = collect_calls(deltas)
    return reasoning, content, [(call.name, json.loads(call.arguments)) for call in calls]


def splits(text: str) -> list[list[str]]:
    """The text whole, a character at a time, and cut in two at every point."""
    return [[text], list(text), *([text[:cut], text[cut:]] for cut in range(1, len(text)))]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_each_familys_calls_at_every_split_of_the_stream(parser, text, content, calls):
    for pieces in splits(text):
        assert run(options(parser), pieces) == ("", content, calls), pieces


@pytest.mark.parametrize(("parser", "text"), CUT_EARLY + UNKNOWN)
def test_a_call_cut_off_before_it_began_or_an_unknown_function_stays_text(parser, text):
    for pieces in splits(text):
        assert run(options(parser), pieces) == ("", text, [])


@pytest.mark.parametrize(("parser", "text"), CUT_IN_ARGUMENTS)
def test_a_call_cut_off_in_its_arguments_keeps_what_was_written(parser, text):
    """As OpenAI's stream does (the finish reason says `length`): the call was already on its
    way to the client, its name first."""
    for pieces in splits(text):
        _, content, deltas = deltas_of(options(parser), pieces)
        [call] = collect_calls(deltas)
        assert (content, call.name) == ("", "get_weather"), pieces
        assert '{"city": "Paris"}'.startswith(call.arguments) and call.arguments, pieces


STREAMED = [  # (parser, output): each call's arguments are the model's own text of them
    ("hermes", "Let me check.\n" + hermes("get_weather", PARIS) + hermes("search", NESTED)),
    ("hermes", json.dumps([{"name": "get_weather", "arguments": PARIS},
                           {"name": "search", "arguments": NESTED}], ensure_ascii=False)),
    ("llama3_json", "<|python_tag|>" + llama3("get_weather", PARIS) + "; "
     + llama3("search", NESTED)),
    ("mistral", mistral(("get_weather", PARIS), ("search", NESTED))),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
     '[TOOL_CALLS]search[ARGS]' + json.dumps(NESTED, ensure_ascii=False)),
]


@pytest.mark.parametrize(("parser", "text"), STREAMED)
def test_arguments_stream_in_pieces_after_the_calls_name(parser, text):
    """Fed a character at a time, as OpenAI streams a call: a first delta with its index and
    name, then its arguments in pieces, each piece out as soon as it was generated."""
    parts, deltas, fed = AnswerParts(options(parser)), [], ""
    for char in text:
        fed += char
        for delta in parts.feed(char)[2]:
            deltas.append(delta)
            if delta.name is None:  # nothing is held back: the piece ends where the text does
                assert fed.endswith(delta.arguments), (fed, delta)
    deltas += parts.finish()[2]
    names = [(d.index, d.name) for d in deltas if d.name is not None]
    assert names == [(0, "get_weather"), (1, "search")]
    for index, arguments in ((0, PARIS), (1, NESTED)):
        pieces = [d.arguments for d in deltas if d.index == index]
        assert len(pieces) > 5 and json.loads("".join(pieces)) == arguments, pieces


def test_pythonic_calls_come_one_by_one_as_each_closes():
    parts = AnswerParts(options("pythonic"))
    first, second = "[get_weather(city='Paris'), ", "search(city='Zürich ☂')]"
    assert [(d.index, d.name) for d in parts.feed(first)[2]] == [(0, "get_weather")]
    assert [(d.index, d.name) for d in parts.feed(second)[2]] == [(1, "search")]


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
