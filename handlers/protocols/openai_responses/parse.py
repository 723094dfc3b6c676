"""Validate a Responses body; refuse, by field, what this server cannot do (a 400 in OpenAI's
shape): built-in tools, background mode, reasoning, the Conversations API, stored prompts,
`truncation: auto`, and tool choices other than the function ones."""

from __future__ import annotations

from typing import Any

from handlers.protocols.chat.errors import OpenAIError, validate_body
from handlers.protocols.openai_responses.requests import (
    INCLUDABLE,
    FunctionTool,
    FunctionToolChoice,
    OtherToolChoice,
    ResponsesRequest,
)

UNSUPPORTED = "unsupported_parameter"


def parse_request(body: Any, reasons: bool = False) -> ResponsesRequest:
    """`reasons`: the server splits a reasoning model's thinking off (option.reasoning_parser),
    so `reasoning.effort` and reasoning input items have a meaning."""
    request = validate_body(ResponsesRequest, body)
    _check_unsupported(request, reasons)
    _check_tools(request)
    _check_text_format(request)
    _check_include(request)
    return request


def _unsupported(param: str, what: str) -> OpenAIError:
    return OpenAIError(f"{param}: {what}", param, code=UNSUPPORTED)


def _check_unsupported(request: ResponsesRequest, reasons: bool) -> None:
    if request.background:
        raise _unsupported("background", "background mode is not supported; send the request "
                                         "without it (stream: true answers as it generates)")
    reasoning = request.reasoning or {}
    for key in ("summary", "generate_summary") if reasons else ("effort", "summary",
                                                                  "generate_summary"):
        if reasoning.get(key) not in (None, "none"):
            raise _unsupported(f"reasoning.{key}", "this model does not summarize its "
                               "reasoning" if reasons else "this model does not reason")
    if request.conversation is not None:
        raise _unsupported("conversation", "the Conversations API is not supported; use "
                                           "previous_response_id")
    if request.prompt is not None:
        raise _unsupported("prompt", "stored prompt templates are not supported")
    if request.truncation == "auto":
        raise _unsupported("truncation", "only 'disabled' is supported: an input over the "
                                         "context is refused")


def _check_tools(request: ResponsesRequest) -> None:
    names = []
    for i, tool in enumerate(request.tools or []):
        if not isinstance(tool, FunctionTool):
            raise _unsupported(f"tools[{i}].type", f"built-in tool {tool.type!r} is not "
                                                   "supported; only function tools are")
        names.append(tool.name)
    if len(set(names)) < len(names):
        raise OpenAIError("tools: function names must be unique", "tools", code="invalid_value")
    choice = request.tool_choice
    if isinstance(choice, OtherToolChoice):
        raise _unsupported("tool_choice.type", f"tool_choice of type {choice.type!r} is not "
                                               "supported; use none, auto, required or a "
                                               "function")
    if isinstance(choice, FunctionToolChoice) and choice.name not in names:
        raise OpenAIError(f"tool_choice.name: no function tool named {choice.name!r} in tools",
                          "tool_choice.name", code="invalid_value")
    if choice == "required" and not names:
        raise OpenAIError("tool_choice: 'required' needs function tools", "tool_choice",
                          code="invalid_value")


def _check_text_format(request: ResponsesRequest) -> None:
    fmt = request.text.format if request.text else None
    if fmt is not None and fmt.type != "text" and forced_call(request):
        raise OpenAIError("text.format: cannot be combined with a forced function call "
                          "(tool_choice required or a named function)", "text.format")
    if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
        raise OpenAIError("text.format.schema: required for json_schema", "text.format.schema",
                          code="missing_required_parameter")


def forced_call(request: ResponsesRequest) -> bool:
    return request.tool_choice == "required" or isinstance(request.tool_choice, FunctionToolChoice)


def _check_include(request: ResponsesRequest) -> None:
    for i, value in enumerate(request.include or []):
        if value not in INCLUDABLE:
            raise OpenAIError(f"include[{i}]: unknown value {value!r}", f"include[{i}]",
                              code="invalid_value")
