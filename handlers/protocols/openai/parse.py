"""Validate decoded JSON bodies into request models; every refusal names its field (`param`)."""

from __future__ import annotations

from typing import Any

from handlers.protocols.chat.errors import OpenAIError, validate_body
from handlers.protocols.chat.requests import (
    MAX_STOP_CHARS,
    ChatCompletionRequest,
    GenerationFields,
    NamedToolChoice,
)
from handlers.protocols.openai.requests import CompletionRequest


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    request = validate_body(ChatCompletionRequest, body)
    _check_common(request)
    _check_chat(request)
    return request


def parse_completion_request(body: Any) -> CompletionRequest:
    request = validate_body(CompletionRequest, body)
    _check_common(request)
    _check_completion(request)
    return request


def _check_common(request: GenerationFields) -> None:
    if request.stream_options is not None and not request.stream:
        raise OpenAIError("stream_options: only allowed when stream is true", "stream_options")
    stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
    if sum(map(len, stops)) > MAX_STOP_CHARS:
        raise OpenAIError(f"stop: the stop strings exceed {MAX_STOP_CHARS} characters in all",
                          "stop", code="invalid_value")
    for key in request.logit_bias or {}:
        if not key.lstrip("-").isdigit():
            raise OpenAIError(f"logit_bias: keys must be token ids (got {key!r})", "logit_bias",
                              code="invalid_value")
    field, limit = request.max_output_tokens
    if limit is not None and (request.min_tokens or 0) > limit:
        raise OpenAIError(f"min_tokens: must be <= {field} ({limit})", "min_tokens",
                          code="invalid_value")


def _check_chat(request: ChatCompletionRequest) -> None:
    if request.top_logprobs and not request.logprobs:
        raise OpenAIError("top_logprobs: logprobs must be true when top_logprobs is set",
                          "top_logprobs", code="invalid_value")
    choice = request.tool_choice
    names = [t.function.name for t in request.tools or []]
    if choice not in (None, "none") and not names:
        raise OpenAIError("tool_choice: only allowed when tools are specified", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise OpenAIError(f"tool_choice.function.name: no tool named {choice.function.name!r} "
                          "in tools", "tool_choice.function.name", code="invalid_value")
    if len(set(names)) < len(names):
        raise OpenAIError("tools: function names must be unique", "tools", code="invalid_value")
    if request.continue_final_message and request.add_generation_prompt:
        raise OpenAIError("continue_final_message: cannot be true with add_generation_prompt",
                          "continue_final_message", code="invalid_value")
    _check_response_format(request)


def _check_response_format(request: ChatCompletionRequest) -> None:
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return
    schema = fmt.json_schema.json_schema if fmt.json_schema else None
    if fmt.type == "json_schema" and schema is None:
        raise OpenAIError("response_format.json_schema.schema: required for json_schema",
                          "response_format.json_schema.schema",
                          code="missing_required_parameter")
    if forced_tool_call(request):
        raise OpenAIError("response_format: cannot be combined with a forced tool call "
                          "(tool_choice required or a named function)", "response_format")


def forced_tool_call(request: ChatCompletionRequest) -> bool:
    return request.tool_choice == "required" or isinstance(request.tool_choice, NamedToolChoice)


def _check_completion(request: CompletionRequest) -> None:
    if request.best_of is not None:
        if request.best_of < request.n:
            raise OpenAIError(f"best_of: must be >= n ({request.n})", "best_of",
                              code="invalid_value")
        if request.stream and request.best_of > 1:
            raise OpenAIError("best_of: cannot be used with stream", "best_of")
    if request.prompt in ("", []) or request.prompt == [[]]:
        raise OpenAIError("prompt: must not be empty", "prompt", code="invalid_value")
