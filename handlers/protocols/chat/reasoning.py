"""Reasoning parsers (`option.reasoning_parser`, vLLM's names): a reasoning model's output
split into its thinking and its answer, as the text streams.

The `<think>` families mark the thinking with `<think>` … `</think>`; they differ in where it
starts, as vLLM's parsers of the same names do:

- `deepseek_r1`: DeepSeek-R1's chat template opens the thinking in the prompt, so the output
  is thinking from its first character (a `<think>` the model writes anyway is dropped) until
  `</think>`; an output that never closes it is all thinking.
- `qwen3`: thinking only inside `<think>` … `</think>` written by the model; an output without
  `<think>` is all answer (the template's thinking switched off, or a model that answered
  straight away).
- `granite` (Granite 3.2's thinking mode): thinking after "Here is my thought process:" (or
  "Here's …") until "Here is my response:" (or "Here's …"); an output that does not open with
  it is all answer.

`ReasoningSplitter.feed` takes the text as it streams and returns what is known to be thinking
and answer so far; a tail that may begin a tag is held until the next piece says what it is.
Whatever way the text is cut into pieces, the parts it returns join to the same two texts.
"""

from __future__ import annotations

from dataclasses import dataclass

from handlers.config.keys import REASONING_PARSERS
from handlers.protocols.chat.tags import partial_tag_length

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Markers:
    opens: tuple[str, ...]  # what opens the thinking (the first is the family's own)
    closes: tuple[str, ...]  # what ends it: the engine waits for one before the grammar
    thinking_first: bool  # the template opened the thinking: the output starts inside it


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""

    def __add__(self, other: Split) -> Split:
        return Split(self.reasoning + other.reasoning, self.content + other.content)


class ReasoningSplitter:
    """One output's text into thinking and answer, by a family's markers."""

    def __init__(self, markers: Markers) -> None:
        # before: an opening may still come (thinking_first: dropped; else it opens the
        # thinking); thinking: until a closing; answer: the rest.
        self._state = "before"
        self._markers = markers
        self._thinking_first = markers.thinking_first
        self._held = ""

    def feed(self, text: str) -> Split:
        self._held += text
        out = Split()
        while self._held:
            step = self._step()
            if step is None:
                break
            out += step
        return out

    def finish(self) -> Split:
        """The held tail, at the end of the output: it is what the state says it is."""
        held, self._held = self._held, ""
        if self._state == "thinking" or (self._state == "before" and self._thinking_first):
            return Split(reasoning=held)
        return Split(content=held)

    def _step(self) -> Split | None:
        """Consume what can be decided now; None when the held text must wait for more."""
        if self._state == "answer":
            text, self._held = self._held, ""
            return Split(content=text)
        if self._state == "before":
            return self._before()
        return self._thinking()

    def _before(self) -> Split | None:
        stripped = self._held.lstrip()
        opens = self._markers.opens
        if not stripped or any(len(stripped) < len(o) and o.startswith(stripped) for o in opens):
            return None  # whitespace, or the beginning of an opening: wait
        opening = next((o for o in opens if stripped.startswith(o)), None)
        if opening is not None:
            self._held = stripped[len(opening):]
            self._state = "thinking"
            return Split()
        self._state = "thinking" if self._thinking_first else "answer"
        return Split()

    def _thinking(self) -> Split | None:
        found = [(at, close) for close in self._markers.closes
                 if (at := self._held.find(close)) >= 0]
        if found:
            end, close = min(found)
            reasoning, self._held = self._held[:end], self._held[end + len(close):]
            self._state = "answer"
            return Split(reasoning=reasoning)
        keep = max(partial_tag_length(self._held, close) for close in self._markers.closes)
        cut = len(self._held) - keep
        if cut == 0:
            return None
        reasoning, self._held = self._held[:cut], self._held[cut:]
        return Split(reasoning=reasoning)


MARKERS = {
    "deepseek_r1": Markers((OPEN,), (CLOSE,), thinking_first=True),
    "qwen3": Markers((OPEN,), (CLOSE,), thinking_first=False),
    "granite": Markers(("Here is my thought process:", "Here's my thought process:"),
                       ("Here is my response:", "Here's my response:"), thinking_first=False),
}
assert set(MARKERS) == set(REASONING_PARSERS), "config/keys.py names the parsers served here"


def splitter(name: str | None) -> ReasoningSplitter | None:
    """The parser `option.reasoning_parser` names; None: no parser, the text is all answer."""
    return None if name is None else ReasoningSplitter(MARKERS[name])


def thinking_marks(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What ends the thinking of parser `name`'s family (the engine waits for one), and what
    opens it where the model decides to think (none: the output starts inside it)."""
    markers = MARKERS[name]
    return markers.closes, () if markers.thinking_first else markers.opens
