"""`hermes` (Qwen 2.5/3, Hermes, SmolLM3), and the default for templates that render no tools
(tool_calls.py asks those for this format): a `<tool_call>` block per call anywhere in the
answer, holding one JSON call (its closing tag may be missing at the very end); or an answer
that opens with JSON calls, one object or a list of them."""

from __future__ import annotations

from itertools import count

from handlers.protocols.chat.tags import partial_tag_length
from handlers.protocols.chat.tool_calls import CLOSE, OPEN, CallDelta, parse_call_text
from handlers.protocols.chat.tool_parsers.reading import CallSequence, JsonCall


class HermesParser:
    """Text that may still become a call is held: a partial `<tool_call>` tag, a block whose
    call has not started, an answer opening with `{` or `[` until it is known to be calls."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self._numbers = count()
        self._held = ""  # text: a tail that may begin a tag; in a block: the block's text
        self._mode = "start"  # start (only whitespace so far) | json | text | block
        self._json: CallSequence | None = None
        self._call: JsonCall | None = None  # the open block's

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        if self._mode == "start":
            self._held += text
            stripped = self._held.lstrip()
            if not stripped:
                return "", []
            text, self._held = self._held, ""
            self._mode = "json" if stripped[0] in "{[" else "text"
            self._json = CallSequence(self.names, self._numbers)
        if self._mode == "json":
            assert self._json is not None
            deltas = self._json.feed(text)
            if not self._json.done:
                return "", deltas
            self._mode = "text"
            content, more = self._text(self._json.rest)
            return content, deltas + more
        return self._text(text)

    def finish(self) -> tuple[str, list[CallDelta]]:
        if self._mode == "json":
            assert self._json is not None
            deltas = self._json.finish()
            return self._json.rest, deltas
        held, self._held = self._held, ""
        if self._mode == "block":
            return self._block_end(held)
        return held, []

    def _text(self, text: str) -> tuple[str, list[CallDelta]]:
        self._held += text
        content, deltas = "", []
        while True:
            if self._mode == "block":
                block, more, closed = self._block()
                content, deltas = content + block, deltas + more
                if not closed:
                    return content, deltas
                self._mode = "text"
            start = self._held.find(OPEN)
            if start < 0:
                cut = len(self._held) - partial_tag_length(self._held, OPEN)
                content, self._held = content + self._held[:cut], self._held[cut:]
                return content, deltas
            content += self._held[:start]
            self._held, self._mode, self._call = self._held[start + len(OPEN):], "block", None

    def _block(self) -> tuple[str, list[CallDelta], bool]:
        """The open block's deltas so far, and whether it closed (its text, as content, when
        it held no call)."""
        body = self._held
        if self._call is None and body.lstrip().startswith("{"):
            start = len(body) - len(body.lstrip())
            self._call = JsonCall(start, self.names, lambda: next(self._numbers), lambda: None)
        deltas = self._call.read(body) if self._call else []
        if self._call is not None and self._call.started:
            after = self._call.end or self._call.arguments_end  # a tag in the call is text
            close = body.find(CLOSE, after) if after is not None else -1
            if close >= 0:
                self._held = body[close + len(CLOSE):]
            return "", deltas, close >= 0
        close = body.find(CLOSE)
        if close < 0:
            return "", deltas, False
        self._held = body[close + len(CLOSE):]
        content, more = self._block_end(body[:close], closing=CLOSE)
        return content, deltas + more, True

    def _block_end(self, body: str, closing: str = "") -> tuple[str, list[CallDelta]]:
        """A block that ended (`closing`: its tag, or none where the answer did): its call read
        whole where it did not stream, else its text."""
        if self._call is not None and self._call.started:
            return "", []
        call = parse_call_text(body, self.names)
        if call is None:
            return OPEN + body + closing, []
        return "", [CallDelta(next(self._numbers), call.arguments, call.name)]
