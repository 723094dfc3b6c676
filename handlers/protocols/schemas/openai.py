"""OpenAI's answers: chat completions, completions, embeddings, the model list, errors."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from handlers.protocols.schemas.common import Open


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorBody(BaseModel):
    error: ErrorDetail


class Usage(Open):
    prompt_tokens: int
    completion_tokens: int | None = None
    total_tokens: int


class ChatMessageOut(Open):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(Open):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletion(Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prefill_time: float | None = None
    decode_time_arr: list[float] | None = None


class CompletionChoice(Open):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class Completion(Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # str: base64 little-endian float32 (`encoding_format`)


class EmbeddingList(Open):
    id: str
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: Usage


class ModelCard(Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    """`GET /v1/models`: OpenAI's list (`data`) and KServe V1's (`models`) in one object."""

    object: Literal["list"]
    data: list[ModelCard]
    models: list[str]
