"""Anthropic's Messages answers: the message, the token count, errors."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from handlers.protocols.schemas.common import Open


class AnthropicUsage(Open):
    input_tokens: int
    output_tokens: int


class AnthropicMessage(Open):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]  # `text` and `tool_use` blocks
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: AnthropicUsage


class InputTokens(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail
