"""Reasoning parsers (`option.reasoning_parser`, vLLM's names): a reasoning model's output
split into its thinking and its answer, as the text streams.

Both families here mark the thinking with `<think>` … `</think>`; they differ in where it
starts, as vLLM's parsers of the same names do:

- `deepseek_r1`: DeepSeek-R1's chat template opens the thinking in the prompt, so the output
  is thinking from its first character (a `<think>` the model writes anyway is dropped) until
  `</think>`; an output that never closes it is all thinking.
- `qwen3`: thinking only inside `<think>` … `</think>` written by the model; an output without
  `<think>` is all answer (the template's thinking switched off, or a model that answered
  straight away).

`ReasoningSplitter.feed` takes the text as it streams and returns what is known to be thinking
and answer so far; a tail that may begin a tag is held until the next piece says what it is.
Whatever way the text is cut into pieces, the parts it returns join to the same two texts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from handlers.config.keys import REASONING_PARSERS

OPEN, CLOSE = "<think>", "</think>"
THINKING_END = CLOSE  # what the engine waits for before it constrains the answer


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""

    def __add__(self, other: Split) -> Split:
        return Split(self.reasoning + other.reasoning, self.content + other.content)


class ReasoningSplitter:
    """One output's text into thinking and answer. `thinking_first`: the output starts inside
    the thinking (DeepSeek-R1's template opened it)."""

    def __init__(self, thinking_first: bool) -> None:
        # before: a leading `<think>` may still come (thinking_first: dropped; else it opens
        # the thinking); thinking: until `</think>`; answer: the rest.
        self._state = "before"
        self._thinking_first = thinking_first
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
        if not stripped or (len(stripped) < len(OPEN) and OPEN.startswith(stripped)):
            return None  # whitespace, or the beginning of `<think>`: wait
        if stripped.startswith(OPEN):
            self._held = stripped[len(OPEN):]
            self._state = "thinking"
            return Split()
        self._state = "thinking" if self._thinking_first else "answer"
        return Split()

    def _thinking(self) -> Split | None:
        end = self._held.find(CLOSE)
        if end >= 0:
            reasoning, self._held = self._held[:end], self._held[end + len(CLOSE):]
            self._state = "answer"
            return Split(reasoning=reasoning)
        keep = _tag_prefix_length(self._held, CLOSE)
        cut = len(self._held) - keep
        if cut == 0:
            return None
        reasoning, self._held = self._held[:cut], self._held[cut:]
        return Split(reasoning=reasoning)


def _tag_prefix_length(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that begins `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


PARSERS: dict[str, Callable[[], ReasoningSplitter]] = {
    "deepseek_r1": lambda: ReasoningSplitter(thinking_first=True),
    "qwen3": lambda: ReasoningSplitter(thinking_first=False),
}
assert set(PARSERS) == set(REASONING_PARSERS), "config/keys.py names the parsers served here"


def splitter(name: str | None) -> ReasoningSplitter | None:
    """The parser `option.reasoning_parser` names; None: no parser, the text is all answer."""
    return None if name is None else PARSERS[name]()
