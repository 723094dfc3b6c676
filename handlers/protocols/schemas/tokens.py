"""vLLM's tokenizer answers: `/tokenize` and `/detokenize`."""

from __future__ import annotations

from pydantic import BaseModel


class TokenizeAnswer(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeAnswer(BaseModel):
    prompt: str
