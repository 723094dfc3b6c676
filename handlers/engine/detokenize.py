"""Incremental detokenization and stop strings: the text each generated token releases.

`tokenizers.decoders.DecodeStream` turns ids into text as they arrive, holding back the bytes of a
character that byte-level BPE split across tokens, in constant work per token. `StopMatcher` then
holds back only a tail that could still begin a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# The prompt's last tokens seed the stream so the first generated token decodes as it would mid-text
# (a Metaspace tokenizer drops the leading space of a text's first token) without echoing them.
_PROMPT_CONTEXT_TOKENS = 5


def backend_tokenizer(tokenizer: Any) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind a transformers tokenizer (or the tokenizer itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TypeError(f"{type(tokenizer).__name__} has no `tokenizers` backend")
    return backend


def token_text(tokenizer: Any, token_id: int) -> str:
    """The standalone text of one token, special tokens included (for logprob alternatives).

    Not cached: the Rust decode of one id costs under a microsecond. A token that holds only part
    of a multi-byte character reads as U+FFFD on its own.
    """
    return backend_tokenizer(tokenizer).decode([token_id], skip_special_tokens=False)


class StopMatcher:
    """Finds stop strings in streamed text, holding back only a tail that may begin one."""

    def __init__(self, stops: Sequence[str], include_stop: bool) -> None:
        self._stops = [s for s in dict.fromkeys(stops) if s]
        self._first_chars = {s[0] for s in self._stops}
        self._longest = max((len(s) for s in self._stops), default=0)
        self._include = include_stop
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text safe to release now; on a match, the text before the stop and nothing after."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        match = self._first_match(buf)
        if match is not None:
            start, stop = match
            self.stopped = True
            self._held = ""
            return buf[:start] + (stop if self._include else "")
        cut = self._partial_start(buf)
        self._held = buf[cut:]
        return buf[:cut]

    def flush(self) -> str:
        """Release the held tail: the sequence ended, so it can no longer become a stop."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        # The stop that completes first wins, as it would if the text arrived a character at a
        # time; at the same end the longer one (earlier start) wins.
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key < best:
                    best = key
        return None if best is None else (best[1], best[2])

    def _partial_start(self, buf: str) -> int:
        # Where the longest suffix of `buf` that is a proper prefix of some stop begins.
        for i in range(max(0, len(buf) - self._longest + 1), len(buf)):
            if buf[i] in self._first_chars and any(s.startswith(buf[i:]) for s in self._stops):
                return i
        return len(buf)


class IncrementalDetokenizer:
    """One generated sequence's detokenizer: feed token ids, get the text each one releases.

    The concatenation of every `add` and the final `flush` is the sequence's text: equal to
    decoding all its ids at once, cut at the first stop string.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop_sequences: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._backend = backend_tokenizer(tokenizer)
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._stops = StopMatcher(stop_sequences, include_stop_str_in_output)
        self._released: list[str] = []

    @property
    def stopped(self) -> bool:
        """A stop string matched; the engine finishes the sequence with `stop_sequence`."""
        return self._stops.stopped

    @property
    def text(self) -> str:
        """All text released so far."""
        return "".join(self._released)

    def add(self, token_id: int) -> str:
        """The text `token_id` releases ("" while a character or a possible stop is incomplete)."""
        if self._stops.stopped:
            return ""
        piece = self._stream.step(self._backend, token_id) or ""
        return self._release(self._stops.feed(piece))

    def flush(self) -> str:
        """At finish, release the tail held for a possible stop string.

        Bytes of a character the sequence never completed stay unreleased: they could only be
        shown as U+FFFD.
        """
        return self._release(self._stops.flush())

    def _release(self, text: str) -> str:
        if text:
            self._released.append(text)
        return text
