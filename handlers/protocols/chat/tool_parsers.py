"""Tool-call parsers per model family (`option.tool_call_parser`, vLLM's names): how the models
whose chat templates render tools themselves write their calls.

- `hermes` (Qwen 2.5/3, Hermes, SmolLM3): `<tool_call>{"name", "arguments"}</tool_call>` blocks,
  the format tool_calls.py also asks templates without tools for (the default parser);
- `llama3_json` (Llama 3.1-3.3): the answer is a JSON call `{"name", "parameters"}` (after
  `<|python_tag|>` where the special token is kept), several separated by `;`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of calls, or `name[ARGS]{arguments}` per call
  (newer tokenizers); the marker is a special token, gone from the text unless the request keeps
  special tokens (`skip_special_tokens: false`), so a JSON list of calls is read without it too;
  Mistral's templates want 9-character call ids, which these calls get;
- `pythonic` (Llama 3.2/4): a Python list of calls, `[get_weather(city="Paris"), f()]`, with
  literal arguments (optionally between `<|python_start|>` and `<|python_end|>`).

Each parser streams as tool_calls.ToolCallParser does: `feed` returns the content that can be
shown now and the calls completed; text that may still become a call is held until `finish`.
A call that does not parse, or names a function not offered, stays text.
"""

from __future__ import annotations

import ast
import json
import secrets
import string
from collections.abc import Callable
from typing import Any, Protocol

from handlers.config.keys import TOOL_CALL_PARSERS
from handlers.protocols.chat.tags import partial_tag_length
from handlers.protocols.chat.tool_calls import ParsedCall, ToolCallParser, parse_call


class CallParser(Protocol):
    def feed(self, text: str) -> tuple[str, list[ParsedCall]]: ...

    def finish(self) -> tuple[str, list[ParsedCall]]: ...


class _Tail:
    """A parser for families whose calls fill the rest of the answer once they begin: the
    answer opens with one of `starts` (after whitespace), or `marker` comes anywhere, text
    before it being content; from there on everything is held and parsed whole at the end."""

    starts: tuple[str, ...] = ()
    marker: str | None = None

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self._held = ""
        self._calls = False  # whether the held text opened calls
        self._said = False  # whether content went out (the answer no longer opens)

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._held += text
        if self._calls:
            return "", []
        if not self._said:
            stripped = self._held.lstrip()
            if any(stripped.startswith(start) for start in self.starts):
                self._calls = True
                return "", []
            if not stripped or any(start.startswith(stripped) for start in self.starts):
                return "", []  # whitespace, or the beginning of an opening: wait
        content = self._before_marker()
        self._said = self._said or bool(content)
        return content, []

    def _before_marker(self) -> str:
        """The content before `marker` (or before a tail that may begin it), the rest held."""
        at = self._held.find(self.marker) if self.marker else -1
        if at >= 0:
            self._calls = True
        else:
            at = len(self._held) - (partial_tag_length(self._held, self.marker)
                                    if self.marker else 0)
        content, self._held = self._held[:at], self._held[at:]
        return content

    def finish(self) -> tuple[str, list[ParsedCall]]:
        held, self._held = self._held, ""
        if not self._calls:
            return held, []
        calls = self.parse(held.strip())
        return ("", calls) if calls else (held, [])

    def parse(self, text: str) -> list[ParsedCall] | None:
        raise NotImplementedError


class Llama3JsonParser(_Tail):
    starts = ("<|python_tag|>", "{")

    def parse(self, text: str) -> list[ParsedCall] | None:
        values = _json_values(text.removeprefix("<|python_tag|>"), ";")
        calls = [parse_call(value, self.names) for value in values or []]
        return calls if calls and None not in calls else None  # type: ignore[return-value]


class MistralParser(_Tail):
    starts = ("[",)  # a JSON list of calls, its marker skipped as a special token
    marker = "[TOOL_CALLS]"

    def parse(self, text: str) -> list[ParsedCall] | None:
        body = text.removeprefix("[TOOL_CALLS]").strip()
        if body.startswith("["):
            values = _json_values(body, "")
            items = values[0] if values and len(values) == 1 else None
            calls = [parse_call(v, self.names) for v in items] \
                if isinstance(items, list) else []
        else:
            calls = self._named_calls(body)
        if not calls or None in calls:
            return None
        return [ParsedCall(c.name, c.arguments, _mistral_id()) for c in calls]  # type: ignore

    def _named_calls(self, body: str) -> list[ParsedCall | None]:
        """`name[ARGS]{...}` repeated, each call after its own `[TOOL_CALLS]`."""
        calls: list[ParsedCall | None] = []
        for part in filter(None, (p.strip() for p in body.split("[TOOL_CALLS]"))):
            name, sep, arguments = part.partition("[ARGS]")
            values = _json_values(arguments, "") if sep else None
            calls.append(parse_call({"name": name.strip(), "arguments": values[0]}, self.names)
                         if values and len(values) == 1 else None)
        return calls


class PythonicParser(_Tail):
    starts = ("<|python_start|>", "[")

    def parse(self, text: str) -> list[ParsedCall] | None:
        body = text.removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = [self._call(node) for node in tree.elts]
        return calls if None not in calls else None  # type: ignore[return-value]

    def _call(self, node: ast.expr) -> ParsedCall | None:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except (ValueError, TypeError, SyntaxError):
            return None
        if None in arguments:  # **kwargs
            return None
        return parse_call({"name": node.func.id, "arguments": arguments}, self.names)


def _json_values(text: str, separator: str) -> list[Any] | None:
    """The JSON values `text` holds one after another (`separator` and whitespace between
    them); None when anything else is there."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or (separator and text[at] == separator)):
            at += 1
        if at == len(text):
            return values or None
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


def _mistral_id() -> str:
    """Mistral's templates accept 9 letters and digits as a call's id."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


PARSERS: dict[str, Callable[[set[str]], CallParser]] = {
    "hermes": ToolCallParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}
assert set(PARSERS) == set(TOOL_CALL_PARSERS), "config/keys.py names the parsers served here"


def call_parser(name: str | None, names: set[str]) -> CallParser:
    """The parser `option.tool_call_parser` names (None: the default, `hermes`'s format with
    its whole-answer JSON fallback)."""
    return PARSERS[name or "hermes"](names)
