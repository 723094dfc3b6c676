"""Log-probabilities of OpenAI's completions: parallel lists, `{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}`, spelled as chat's are (handlers/protocols/chat/logprobs.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from handlers.engine.types import Token
from handlers.protocols.chat.logprobs import TokenText, clamp, scored


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
