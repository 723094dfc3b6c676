"""OpenAI's (legacy) completions body as a pydantic model; the fields it shares with chat, and
chat's own, are handlers/protocols/chat/requests.py."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from handlers.protocols.chat.requests import MAX_TOP_LOGPROBS, GenerationFields


class CompletionRequest(GenerationFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's default is 16 tokens; an explicit null means "up to the context", as in vLLM.
    max_tokens: int | None = Field(16, ge=1, lt=2**31)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=128)
    # Databricks: `truncate` keeps the end of a prompt too long for the context and cuts the
    # output at the context's end instead of a 400; `use_raw_prompt` asks for no template, which
    # completions never apply here.
    error_behavior: Literal["error", "truncate"] = "error"
    use_raw_prompt: bool = False

    @property
    def truncates(self) -> bool:
        return self.error_behavior == "truncate"
