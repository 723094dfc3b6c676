"""Reading tool calls while they stream, for every family's parser.

A call written as a JSON object whose name comes first, `{"name": "f", "arguments": {...}}`
(`parameters` for `arguments`), naming an offered function, starts as soon as its name is read:
its first delta names the function and its arguments follow in pieces, the model's own text of
them, as they are generated (what OpenAI's stream does). Any other item (keys in another order,
arguments as a JSON string, a Python call) is read whole when it closes. Once a call started it
is a call: cut off by max_tokens, its arguments are cut too, as OpenAI's are (the finish reason
says so).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from typing import Protocol

from handlers.protocols.chat.tool_calls import CallDelta, ParsedCall, parse_call, parse_call_text


class Nesting:
    """Where a bracketed value closes in text that streams in: brackets counted outside
    strings (`quotes`: the characters that open one)."""

    def __init__(self, start: int, quotes: str = '"') -> None:
        self.at = start  # the next character to look at
        self.depth = 0
        self.quotes = quotes
        self.quote: str | None = None
        self.escaped = False
        self.closed: int | None = None

    def close(self, text: str) -> int | None:
        """One past the bracket that closes the value, once `text` holds it."""
        if self.closed is not None:
            return self.closed
        for at in range(self.at, len(text)):
            char = text[at]
            if self.quote is not None:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == self.quote:
                    self.quote = None
            elif char in self.quotes:
                self.quote = char
            elif char in "{[(":
                self.depth += 1
            elif char in "}])":
                self.depth -= 1
                if self.depth == 0:
                    self.closed = at + 1
                    return self.closed
        self.at = len(text)
        return None


class Item(Protocol):
    """One call's text, from where it opens."""

    end: int | None  # one past its end, once it closed
    started: bool  # whether it gave a call's first delta

    def read(self, text: str) -> list[CallDelta]: ...

    def whole(self, text: str) -> list[CallDelta]:
        """Once closed, or where the text ended inside it: its call, if it was not streamed."""
        ...


class JsonCall:
    """A call written as a JSON object (see the module's docstring)."""

    head = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]+)"\s*,'
                      r'\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')

    def __init__(self, start: int, names: set[str], number: Callable[[], int],
                 make_id: Callable[[], str | None]) -> None:
        self.start, self.names, self.number, self.make_id = start, names, number, make_id
        self.end: int | None = None
        self.started = False
        self.arguments_end: int | None = None
        self._object = Nesting(start)
        self._arguments: Nesting | None = None  # once the head was read
        self._index = 0
        self._sent = 0  # where the arguments sent so far end

    def read(self, text: str) -> list[CallDelta]:
        deltas = []
        if self._arguments is None and (head := self.head.match(text, self.start)):
            self._arguments, self._sent = Nesting(head.end()), head.end()
            if head[1] in self.names:
                self.started, self._index = True, self.number()
                deltas.append(CallDelta(self._index, name=head[1], id=self.make_id()))
        if self._arguments is not None and self.arguments_end is None:
            self.arguments_end = self._arguments.close(text)
            upto = self.arguments_end or len(text)
            if self.started and upto > self._sent:
                deltas.append(CallDelta(self._index, text[self._sent:upto]))
                self._sent = upto
        self.end = self._close(text)
        return _merged(deltas)

    def _close(self, text: str) -> int | None:
        return self._object.close(text)

    def whole(self, text: str) -> list[CallDelta]:
        if self.started or self.end is None:
            return []
        call = parse_call_text(text[self.start:self.end], self.names)
        if call is None:
            return []
        self.started = True
        return [CallDelta(self.number(), call.arguments, call.name, self.make_id())]


class NamedCall(JsonCall):
    """Mistral's newer form, `name[ARGS]{...}`, each after its own `[TOOL_CALLS]` (the first
    one's read by the parser): always streamed, as the name comes first."""

    head = re.compile(r"(?:\[TOOL_CALLS\])?\s*([^\s\[\]{}]+)\s*\[ARGS\]\s*(?=\{)")

    def _close(self, text: str) -> int | None:
        return self.arguments_end

    def whole(self, text: str) -> list[CallDelta]:
        return []


class PythonCall:
    """A call written as Python, `get_weather(city="Paris")`, literal keyword arguments only:
    read whole when its parenthesis closes."""

    def __init__(self, start: int, names: set[str], number: Callable[[], int],
                 make_id: Callable[[], str | None]) -> None:
        self.start, self.names, self.number, self.make_id = start, names, number, make_id
        self.end: int | None = None
        self.started = False
        self._call = Nesting(start, quotes="'\"")

    def read(self, text: str) -> list[CallDelta]:
        self.end = self._call.close(text)
        return []

    def whole(self, text: str) -> list[CallDelta]:
        call = python_call(text[self.start:self.end], self.names)
        if call is None:
            return []
        self.started = True
        return [CallDelta(self.number(), call.arguments, call.name, self.make_id())]


def python_call(text: str, names: set[str]) -> ParsedCall | None:
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    try:
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    except (ValueError, TypeError, SyntaxError):
        return None
    if None in arguments:  # **kwargs
        return None
    return parse_call({"name": node.func.id, "arguments": arguments}, names)


ItemKind = Callable[[str], "type[JsonCall] | type[PythonCall] | None"]


def json_items(char: str) -> type[JsonCall] | None:
    return JsonCall if char == "{" else None


def python_items(char: str) -> type[PythonCall] | None:
    return PythonCall if char.isidentifier() else None


class CallSequence:
    """Calls one after another, `separators` and whitespace between them, in a list when the
    text opens with `[` (its `]` ends them); `items` tells which kind of call a character opens
    (None: not a call).

    `feed` gives the calls' deltas as they come; once `done` (the list closed, or something
    else than a call came), `rest` is the text that was not calls: all of it when none was
    made, else what follows the last one.
    """

    def __init__(self, names: set[str], numbers: Iterator[int], items: ItemKind = json_items,
                 separators: str = ",", make_id: Callable[[], str | None] = lambda: None
                 ) -> None:
        self.names, self.items, self.separators = names, items, separators
        self._number = lambda: next(numbers)
        self._make_id = make_id
        self.text = ""
        self.made = 0
        self.done = False
        self._at = 0  # the next unread character, between items
        self._list: bool | None = None
        self._item: Item | None = None
        self._rest = 0  # where the text that is not calls begins

    @property
    def rest(self) -> str:
        return self.text if not self.made else self.text[self._rest:]

    def feed(self, text: str) -> list[CallDelta]:
        self.text += text
        deltas: list[CallDelta] = []
        while not self.done:
            if self._item is None and not self._open_item():
                break
            item = self._item
            assert item is not None
            deltas += item.read(self.text)
            if item.end is None:
                break
            deltas += self._close_item(item)
        return deltas

    def finish(self) -> list[CallDelta]:
        """The text ended: an item still open is read as it stands; after calls, what is left
        (a cut-off list's tail) is theirs."""
        if self.done:
            return []
        item, self._item, self.done = self._item, None, True
        deltas = item.whole(self.text) if item is not None and not item.started else []
        self.made += bool(item and item.started)
        if self.made:
            self._rest = len(self.text)
        return deltas

    def _open_item(self) -> bool:
        """Past separators to the next item; False while more text is needed."""
        text, at = self.text, self._at
        while at < len(text) and (text[at].isspace() or text[at] in self.separators):
            at += 1
        self._at = at
        if at == len(text):
            return False
        if self._list is None:
            self._list = text[at] == "["
            if self._list:
                self._at += 1
                return self._open_item()
        kind = self.items(text[at])
        if kind is not None and not (self._list and text[at] == "]"):
            self._item = kind(at, self.names, self._number, self._make_id)
            return True
        self.done, self._rest = True, at + (self._list and text[at] == "]")
        return False

    def _close_item(self, item: Item) -> list[CallDelta]:
        deltas = item.whole(self.text)
        self._item = None
        if not item.started:  # not a call: the calls end here
            self.done, self._rest = True, self._at
            return deltas
        assert item.end is not None
        self.made += 1
        self._at = self._rest = item.end
        return deltas


def _merged(deltas: list[CallDelta]) -> list[CallDelta]:
    """A call's first delta and its first arguments in one."""
    if len(deltas) == 2 and deltas[0].index == deltas[1].index:
        return [CallDelta(deltas[0].index, deltas[1].arguments, deltas[0].name, deltas[0].id)]
    return deltas
