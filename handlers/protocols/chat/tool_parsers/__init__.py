"""Tool-call parsers per model family (`option.tool_call_parser`, vLLM's names): how the models
whose chat templates render tools themselves write their calls (`hermes.py`, `families.py`), read
as they stream (`reading.py`).

A parser's `feed` returns the content that can be shown now and the calls' deltas so far (a
call's first names its function, then its arguments come in pieces); text that may still become
a call is held. A call that does not parse, or names a function not offered, stays text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from handlers.config.keys import TOOL_CALL_PARSERS
from handlers.protocols.chat.tool_calls import CallDelta
from handlers.protocols.chat.tool_parsers.families import (
    Llama3JsonParser,
    MistralParser,
    PythonicParser,
)
from handlers.protocols.chat.tool_parsers.hermes import HermesParser


class CallParser(Protocol):
    def feed(self, text: str) -> tuple[str, list[CallDelta]]: ...

    def finish(self) -> tuple[str, list[CallDelta]]: ...


PARSERS: dict[str, Callable[[set[str]], CallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}
assert set(PARSERS) == set(TOOL_CALL_PARSERS), "config/keys.py names the parsers served here"


def call_parser(name: str | None, names: set[str]) -> CallParser:
    """The parser `option.tool_call_parser` names (None: the default, `hermes`'s format with
    its whole-answer JSON fallback)."""
    return PARSERS[name or "hermes"](names)
