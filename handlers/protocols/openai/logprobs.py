"""Log-probability objects: chat's `{"content": [...]}` and completions' parallel lists.

Token strings are each token's own text (`TokenText`; the engine's `TopToken.text` for
alternatives), not the text it released: a stop-string hold or a split UTF-8 character does not
shift them. Entries without a log-probability (the
engine's flush of held-back text) are not tokens and are skipped. -inf is clamped to -9999.0,
as in vLLM, since JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from handlers.engine.types import Token

TokenText = Callable[[int], str]  # a token id -> its text on its own

MIN_LOGPROB = -9999.0


def clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def scored(tokens: Iterable[Token]) -> list[Token]:
    return [t for t in tokens if t.logprob is not None]


def chat_logprobs(tokens: Iterable[Token], token_text: TokenText, top: int) -> dict[str, Any]:
    """`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`."""
    content = []
    for token in scored(tokens):
        text = token_text(token.id)
        alternatives = [_chat_entry(t.text, t.logprob) for t in token.top[:top]]
        content.append({**_chat_entry(text, token.logprob), "top_logprobs": alternatives})
    return {"content": content}


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": clamp(logprob), "bytes": list(text.encode())}


class CompletionLogprobs:
    """Builds completions' `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
    chunk by chunk; `text_offset` counts from the start of the choice's text (echo included)."""

    def __init__(self, token_text: TokenText, offset: int = 0) -> None:
        self.token_text = token_text
        self.offset = offset

    def prompt(self, tokens: list[Token]) -> dict[str, Any]:
        """Echoed prompt tokens: the first has no log-probability (nothing precedes it)."""
        out = _empty()
        for i, token in enumerate(tokens):
            text = self.token_text(token.id)
            logprob = None if i == 0 or token.logprob is None else clamp(token.logprob)
            self._append(out, text, logprob, None if logprob is None else {text: logprob})
        return out

    def generated(self, tokens: Iterable[Token]) -> dict[str, Any]:
        out = _empty()
        for token in scored(tokens):
            text = self.token_text(token.id)
            top = {t.text: clamp(t.logprob) for t in token.top}
            top.setdefault(text, clamp(token.logprob))  # the chosen token, as vLLM lists it
            self._append(out, text, clamp(token.logprob), top)
        return out

    def _append(self, out: dict[str, Any], text: str, logprob: float | None,
                top: dict[str, float] | None) -> None:
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(self.offset)
        self.offset += len(text)


def merge(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}


def _empty() -> dict[str, Any]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
