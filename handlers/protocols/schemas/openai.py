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


class ResponseUsage(Open):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(Open):
    """The Responses API's response object (`POST` and `GET /v1/responses`); a stream's events
    carry it too. Its request settings (`instructions`, `tools`, `text`...) are repeated."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    model: str
    output: list[dict[str, Any]]  # message and function_call items
    usage: ResponseUsage | None
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool
