"""A generated token as a plain object: in TGI's keys (`id`, `text`, `logprob`, `special`),
as TGI answers and LMI under tgi_compat, or in DJL LMI's (`log_prob`, `special_token` only when
true); with its most likely alternatives in the same keys."""

from __future__ import annotations

from typing import Any

from handlers.engine.types import Token, TopToken

# Stands in for the last token when a sequence finishes in a step that released none.
END_TOKEN = Token(id=-1, text="", logprob=None, special=True)


def token_dict(token: Token, tgi: bool) -> dict[str, Any]:
    """LMI: `special_token` only when true (as DJL); TGI: `special` always (as TGI)."""
    if tgi:
        return {
            "id": token.id, "text": token.text, "logprob": token.logprob, "special": token.special
        }
    out: dict[str, Any] = {"id": token.id, "text": token.text, "log_prob": token.logprob}
    if token.special:
        out["special_token"] = True
    return out


def top_dicts(token: Token, tgi: bool) -> list[dict[str, Any]]:
    key = "logprob" if tgi else "log_prob"
    return [_top_dict(top, key) for top in token.top]


def _top_dict(top: TopToken, key: str) -> dict[str, Any]:
    return {"id": top.id, "text": top.text, key: top.logprob}
