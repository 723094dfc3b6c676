"""The families whose calls fill the rest of the answer once they begin (vLLM's names):

- `llama3_json` (Llama 3.1-3.3): the answer is a JSON call `{"name", "parameters"}` (after
  `<|python_tag|>` where the special token is kept), several separated by `;`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of calls, or `name[ARGS]{arguments}` per call
  (newer tokenizers); the marker is a special token, gone from the text unless the request keeps
  special tokens (`skip_special_tokens: false`), so a JSON list of calls is read without it too;
  Mistral's templates want 9-character call ids, which these calls get;
- `pythonic` (Llama 3.2/4): a Python list of calls, `[get_weather(city="Paris"), f()]`, with
  literal arguments (optionally between `<|python_start|>` and `<|python_end|>`).
"""

from __future__ import annotations

import secrets
import string
from itertools import count

from handlers.protocols.chat.tags import partial_tag_length
from handlers.protocols.chat.tool_calls import CallDelta
from handlers.protocols.chat.tool_parsers.reading import (
    CallSequence,
    JsonCall,
    NamedCall,
    python_items,
)


class _Tail:
    """The answer opens with one of `starts` (after whitespace), or `marker` comes anywhere,
    text before it being content; from there the calls are read as they stream. Where none
    is made, their text is content after all; what follows the last one is content."""

    starts: tuple[str, ...] = ()
    marker: str | None = None
    closing = ""  # a tag that may close the calls, dropped

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self._numbers = count()
        self._held = ""  # before the calls: what may still open them
        self._said = False  # whether content went out (the answer no longer opens)
        self._prefix = ""  # the calls' opening tag, content again if they are not calls
        self._calls: CallSequence | None = None

    def sequence(self) -> CallSequence:
        raise NotImplementedError

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        if self._calls is not None:
            return self._read(text)
        self._held += text
        if not self._said:
            stripped = self._held.lstrip()
            tags = (*self.starts, self.marker or "")
            if not stripped or any(tag.startswith(stripped) and tag != stripped
                                   for tag in tags if len(tag) > 1):
                return "", []  # whitespace, or the beginning of an opening: wait
            if any(stripped.startswith(start) for start in self.starts):
                return self._open(0)
        at = self._held.find(self.marker) if self.marker else -1
        if at >= 0:
            return self._open(at)
        cut = len(self._held) - (partial_tag_length(self._held, self.marker)
                                 if self.marker else 0)
        content, self._held = self._held[:cut], self._held[cut:]
        self._said = self._said or bool(content)
        return content, []

    def finish(self) -> tuple[str, list[CallDelta]]:
        if self._calls is None:
            held, self._held = self._held, ""
            return held, []
        if self._calls.done:  # its rest went out
            return self._after(""), []
        deltas = self._calls.finish()
        return self._after(self._calls.rest), deltas

    def _open(self, at: int) -> tuple[str, list[CallDelta]]:
        """The calls begin at `at` in the held text (after whitespace)."""
        content, opening = self._held[:at], self._held[at:]
        body = opening.lstrip()
        for tag in (*self.starts, self.marker or ""):
            if tag and len(tag) > 1 and body.startswith(tag):
                body = body[len(tag):]
                break
        self._prefix, self._held = opening[:len(opening) - len(body)], ""
        self._calls = self.sequence()
        more, deltas = self._read(body)
        return content + more, deltas

    def _read(self, text: str) -> tuple[str, list[CallDelta]]:
        calls = self._calls
        assert calls is not None
        if calls.done:
            return self._after(text), []
        deltas = calls.feed(text)
        if not calls.done:
            return "", deltas
        return self._after(calls.rest), deltas

    def _after(self, text: str) -> str:
        """Text after the calls, or all of theirs where none was made."""
        assert self._calls is not None
        if not self._calls.made:
            text, self._prefix = self._prefix + text, ""
        elif self.closing:
            text, self._held = self._held + text, ""
            if self.closing.startswith(text.strip()) and text.strip() != self.closing:
                self._held = text  # the closing tag may be arriving
                return ""
            text = text.replace(self.closing, "", 1)
        return text


class Llama3JsonParser(_Tail):
    starts = ("<|python_tag|>", "{")

    def sequence(self) -> CallSequence:
        return CallSequence(self.names, self._numbers, separators=";")


class MistralParser(_Tail):
    starts = ("[",)  # a JSON list of calls, its marker skipped as a special token
    marker = "[TOOL_CALLS]"

    def sequence(self) -> CallSequence:
        return CallSequence(self.names, self._numbers, items=_mistral_items, make_id=_mistral_id)


class PythonicParser(_Tail):
    starts = ("<|python_start|>", "[")
    closing = "<|python_end|>"

    def sequence(self) -> CallSequence:
        return CallSequence(self.names, self._numbers, items=python_items)


def _mistral_items(char: str) -> type[JsonCall] | None:
    """A JSON call in the list form, else `name[ARGS]{...}` (with its own `[TOOL_CALLS]`)."""
    if char == "{":
        return JsonCall
    return NamedCall if char.isidentifier() or char == "[" else None


def _mistral_id() -> str:
    """Mistral's templates accept 9 letters and digits as a call's id."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))
