"""From a Responses body to what the server runs: one engine request, rendered as chat renders
its prompt (the same template, tool prompt and constrained decoding), and how to answer it.

`previous_response_id` continues a stored conversation: its input items (its own history
included) and its output items come before this request's input; its `instructions` do not
carry over, as OpenAI documents.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from handlers.engine.base import Tokenizer
from handlers.engine.types import GenerationRequest, StructuredOutput
from handlers.protocols.chat.answer import (
    PLAIN,
    ChatFormat,
    ChatOptions,
    ResponseContext,
    think_first,
)
from handlers.protocols.chat.errors import OpenAIError, check_model, from_validation_error
from handlers.protocols.chat.logprobs import token_text_of
from handlers.protocols.chat.params import chat_sampling_params
from handlers.protocols.chat.prompt import ChatPrompt, render_chat_prompt
from handlers.protocols.chat.requests import ChatCompletionRequest
from handlers.protocols.chat.structured import structured_output
from handlers.protocols.openai_responses.items import Item, chat_messages
from handlers.protocols.openai_responses.parse import parse_request
from handlers.protocols.openai_responses.render import ResponseOptions
from handlers.protocols.openai_responses.requests import (
    FunctionTool,
    FunctionToolChoice,
    InputItem,
    MessageItem,
    ResponsesRequest,
)

History = Callable[[str], list[dict[str, Any]] | None]  # a stored response's items, by id
ITEMS: TypeAdapter[list[Item]] = TypeAdapter(list[InputItem])
SAMPLING = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty",
            "presence_penalty", "frequency_penalty")


class ResponsesChat(ChatCompletionRequest):
    """The chat request a Responses request runs as; admission names its output cap as the
    Responses API does."""

    @property
    def max_output_tokens(self) -> tuple[str, int | None]:
        return "max_output_tokens", self.max_completion_tokens


@dataclass
class ResponsesJob:
    request: ResponsesRequest
    chat: ResponsesChat
    gen: GenerationRequest
    options: ResponseOptions
    items: list[dict[str, Any]]  # history and this input: what a continuation starts from


def prepare_response(body: Any, tokenizer: Tokenizer, model: str, history: History,
                     adapters: Sequence[str] = (), fmt: ChatFormat = PLAIN
                     ) -> ResponsesJob:
    """`adapters`: the LoRA adapters `model` (the field) may name instead of the model; `fmt`:
    how the model's answers are read (its thinking becomes a `reasoning` item)."""
    reasons = fmt.reasoning_parser is not None
    request = parse_request(body, reasons)
    adapter = check_model(request.model, model, adapters)
    past = _history(request, history)
    items = past + _input_items(request)
    chat = _chat_request(request, chat_messages(request.instructions, items, len(past),
                                                reasons))
    params = chat_sampling_params(chat, _structured(chat))
    prompt = _prompt(tokenizer, chat)
    gen = GenerationRequest(prompt=prompt.text, params=params, adapter=adapter,
                            **prompt.request_media())
    ctx = ResponseContext(f"resp_{gen.request_id}", int(time.time()), adapter or model,
                          token_text_of(tokenizer))
    chat_options = ChatOptions.for_request(chat, dataclasses.replace(fmt, full_text=False))
    think_first(params, chat_options, None, "reasoning")
    options = ResponseOptions(ctx, echo_fields(request), chat_options, request.logprobs,
                              request.top_logprobs or 0)
    stored = [item.model_dump(by_alias=True, exclude_none=True) for item in items]
    return ResponsesJob(request, chat, gen, options, stored)


def _history(request: ResponsesRequest, history: History) -> list[Item]:
    previous = request.previous_response_id
    if previous is None:
        return []
    items = history(previous)
    if items is None:
        raise OpenAIError(f"previous_response_id: no stored response {previous!r} (not stored, "
                          "deleted, or evicted)", "previous_response_id",
                          code="previous_response_not_found")
    return ITEMS.validate_python(items)


def _input_items(request: ResponsesRequest) -> list[Item]:
    if isinstance(request.input, str):
        return [MessageItem(role="user", content=request.input)]
    return list(request.input or [])


def _chat_request(request: ResponsesRequest, messages: list[dict[str, Any]]) -> ResponsesChat:
    fields: dict[str, Any] = {name: getattr(request, name) for name in SAMPLING}
    fields |= {"messages": messages, "max_completion_tokens": request.max_output_tokens,
               "stream": request.stream, "parallel_tool_calls": request.parallel_tool_calls,
               "logprobs": request.logprobs,
               "top_logprobs": request.top_logprobs if request.logprobs else None}
    tools = [t for t in request.tools or [] if isinstance(t, FunctionTool)]
    if tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"})}
                           for t in tools]
        choice = request.tool_choice or "auto"
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}} \
            if isinstance(choice, FunctionToolChoice) else choice
    effort = (request.reasoning or {}).get("effort")
    if effort is not None:  # for templates that read it (vLLM's reasoning_effort); none: off
        fields["chat_template_kwargs"] = {"reasoning_effort": effort,
                                          **({"enable_thinking": False} if effort == "none"
                                             else {})}
    fmt = request.text.format if request.text else None
    if fmt is not None and fmt.type != "text":
        schema = {"name": fmt.name or "response", "schema": fmt.json_schema, "strict": fmt.strict}
        fields["response_format"] = {"type": fmt.type, "json_schema": schema
                                     if fmt.type == "json_schema" else None}
    try:
        return ResponsesChat.model_validate(fields)
    except ValidationError as exc:  # a bug here rather than the client's: say which field
        raise from_validation_error(exc) from None


def _structured(chat: ResponsesChat) -> StructuredOutput | None:
    """Chat's constraint, blamed on the Responses field an engine refusal should name."""
    spec = structured_output(chat)
    if spec is None:
        return None
    param = spec.param.replace("response_format.json_schema.schema", "text.format.schema")
    param = param.replace("response_format", "text.format").replace(".function.", ".")
    return dataclasses.replace(spec, param=param)


def _prompt(tokenizer: Tokenizer, chat: ResponsesChat) -> ChatPrompt:
    try:
        return render_chat_prompt(tokenizer, chat)
    except OpenAIError as exc:  # chat names its messages; here they came from `input`
        param = exc.param if (exc.param or "").startswith("input") else "input"
        raise OpenAIError(exc.message.replace("messages", "input", 1), param,
                          code=exc.code) from None


def echo_fields(request: ResponsesRequest) -> dict[str, Any]:
    """The settings every response object repeats, with OpenAI's defaults filled in."""
    fmt = request.text.format if request.text and request.text.format else None
    text: dict[str, Any] = {"format": fmt.model_dump(by_alias=True, exclude_none=True)
                            if fmt else {"type": "text"}}
    if request.text and request.text.verbosity:
        text["verbosity"] = request.text.verbosity
    choice = request.tool_choice or "auto"
    return {
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": request.max_tool_calls,
        "metadata": request.metadata or {},
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": (request.reasoning or {}).get("effort"), "summary": None},
        "store": request.store is not False,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "text": text,
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "tools": [t.model_dump() for t in request.tools or []],
        "top_logprobs": request.top_logprobs or 0,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "truncation": "disabled",
        "background": False,
        "user": request.user,
    }
