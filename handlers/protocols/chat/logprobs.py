"""Log-probabilities as chat answers spell them (`{"content": [...]}`, which the Responses
API's output text reuses), and the token text they and OpenAI's completions are spelled with.

Token strings are each token's own text (`TokenText`; the engine's `TopToken.text` for
alternatives), not the text it released: a stop-string hold or a split UTF-8 character does not
shift them. Entries without a log-probability (the
engine's flush of held-back text) are not tokens and are skipped. -inf is clamped to -9999.0,
as in vLLM, since JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from handlers.engine.base import Tokenizer
from handlers.engine.types import Token

TokenText = Callable[[int], str]  # a token id -> its text on its own

MIN_LOGPROB = -9999.0


def token_text_of(tokenizer: Tokenizer) -> TokenText:
    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return token_text


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
