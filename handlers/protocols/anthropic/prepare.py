"""From a Messages body to what the server runs.

The conversation becomes a chat completion request, so that it renders through the same chat
template, tool-call format and constrained decoding as `/v1/chat/completions` (as vLLM's
Anthropic endpoint does): `system` is the system message; an assistant's `tool_use` blocks are
its tool calls; a user's `tool_result` blocks are `tool` messages (in place, before the text
that follows them); text blocks are text parts. A conversation ending with an assistant message
is continued (Anthropic's prefill). `tool_choice` `auto` / `any` / `tool` / `none` is chat's
`auto` / `required` / the named function / `none`, so `any` and `tool` force a call through
constrained decoding.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from handlers.engine.base import Tokenizer
from handlers.engine.prompt_tokens import fewest_tokens
from handlers.engine.types import GenerationRequest
from handlers.protocols.adapters import UnknownAdapter, adapter_named
from handlers.protocols.anthropic.errors import AnthropicError, in_anthropic_terms, model_not_found
from handlers.protocols.anthropic.render import MessageContext
from handlers.protocols.anthropic.requests import (
    AnthropicTool,
    CountTokensRequest,
    MediaBlockParam,
    MessageParam,
    MessagesRequest,
    TextBlockParam,
    ThinkingBlockParam,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolChoice,
    ToolChoiceAny,
    ToolChoiceTool,
    ToolResultBlockParam,
    ToolUseBlockParam,
)
from handlers.protocols.bodies import parse_body
from handlers.protocols.chat.answer import PLAIN, ChatFormat, ChatOptions, think_first
from handlers.protocols.chat.params import chat_sampling_params
from handlers.protocols.chat.prompt import media_prompt_ids, render_chat_prompt
from handlers.protocols.chat.requests import MAX_STOP_CHARS, ChatCompletionRequest
from handlers.protocols.chat.structured import structured_output

R = TypeVar("R", bound=CountTokensRequest)


@dataclass
class MessagesJob:
    request: MessagesRequest
    gen: GenerationRequest
    chat: ChatCompletionRequest  # the same conversation as a chat request (its output length)
    context: MessageContext


def prepare_messages(body: Any, tokenizer: Tokenizer, model: str,
                     adapters: Sequence[str] = (), fmt: ChatFormat = PLAIN
                     ) -> MessagesJob:
    """`adapters`: the LoRA adapters `model` (the field) may name instead of the model; `fmt`:
    how the model's answers are read (its thinking becomes `thinking` blocks)."""
    request, adapter = _parse(MessagesRequest, body, model, adapters)
    chat = chat_request(request)
    with in_anthropic_terms():
        prompt = render_chat_prompt(tokenizer, chat)
    params = chat_sampling_params(chat, structured_output(chat))
    # The stop sequence stays in the engine's text so the answer can say which one matched;
    # the rendering cuts it off, as Anthropic never returns it.
    params.include_stop_str_in_output = True
    gen = GenerationRequest(prompt=prompt.text, params=params, adapter=adapter,
                            **prompt.request_media())
    budget = request.thinking.budget_tokens \
        if isinstance(request.thinking, ThinkingEnabled) else None
    with in_anthropic_terms():
        options = ChatOptions.for_request(chat, replace(fmt, full_text=False))
        think_first(params, options, budget, "thinking.budget_tokens")
    context = MessageContext(f"msg_{gen.request_id}", adapter or model, options,
                             tuple(request.stop_sequences or ()))
    return MessagesJob(request, gen, chat, context)


def count_tokens(body: Any, tokenizer: Tokenizer, model: str, max_model_len: int,
                 adapters: Sequence[str] = ()) -> dict[str, int]:
    """`input_tokens`: the prompt as `/v1/messages` renders and the engine tokenizes it. A
    prompt the context cannot hold is refused, as Anthropic refuses one ("prompt is too long"),
    before it is tokenized where its bytes prove it (engine/prompt_tokens.py)."""
    request, _ = _parse(CountTokensRequest, body, model, adapters)  # adapters share it
    with in_anthropic_terms():
        prompt = render_chat_prompt(tokenizer, chat_request(request))
        # With media, the model's processor counts them.
        count = len(media_prompt_ids(tokenizer, prompt)) if prompt.media \
            else _text_tokens(prompt.text, tokenizer, max_model_len)
    if count >= max_model_len:
        raise _too_long(str(count), max_model_len)
    return {"input_tokens": count}


def _text_tokens(text: str, tokenizer: Tokenizer, max_model_len: int) -> int:
    if (fewest := fewest_tokens(text, tokenizer.token_bound)) >= max_model_len:
        raise _too_long(f"at least {fewest}", max_model_len)
    return len(tokenizer.encode(text))


def _too_long(tokens: str, max_model_len: int) -> AnthropicError:
    return AnthropicError(f"prompt is too long: {tokens} tokens > {max_model_len - 1} maximum "
                          f"(the model's context is {max_model_len} tokens, prompt and "
                          "generated tokens together)")


def _adapter(requested: str | None, model: str, adapters: Sequence[str]) -> str | None:
    """The LoRA adapter `model` names (None: the served model); 404 for another model."""
    try:
        return adapter_named(requested, model, adapters)
    except UnknownAdapter as exc:
        raise model_not_found(exc.name, model, adapters) from None


def _parse(kind: type[R], body: Any, model: str, adapters: Sequence[str]
           ) -> tuple[R, str | None]:
    """The request, and the LoRA adapter its `model` names (None: the served model)."""
    request = parse_body(kind, body, AnthropicError, "the request body must be a JSON object")
    adapter = _adapter(request.model, model, adapters)
    _check_tools(request)
    if isinstance(request, MessagesRequest) and \
            sum(map(len, request.stop_sequences or [])) > MAX_STOP_CHARS:
        raise AnthropicError(f"stop_sequences: more than {MAX_STOP_CHARS} characters in all")
    if isinstance(request, MessagesRequest) and isinstance(request.thinking, ThinkingEnabled) \
            and request.thinking.budget_tokens >= request.max_tokens:
        raise AnthropicError("thinking.budget_tokens: must be less than max_tokens "
                             f"({request.thinking.budget_tokens} >= {request.max_tokens})")
    return request, adapter


def _check_tools(request: CountTokensRequest) -> None:
    names = [tool.name for tool in request.tools or []]
    if len(set(names)) < len(names):
        raise AnthropicError("tools: tool names must be unique")
    choice = request.tool_choice
    if isinstance(choice, ToolChoiceAny | ToolChoiceTool) and not names:
        raise AnthropicError(f"tool_choice: '{choice.type}' needs tools")
    if isinstance(choice, ToolChoiceTool) and choice.name not in names:
        raise AnthropicError(f"tool_choice.name: no tool named {choice.name!r} in tools")


def chat_request(request: CountTokensRequest) -> ChatCompletionRequest:
    messages = _system(request.system)
    for index, message in enumerate(request.messages):
        messages += _converted(message, f"messages.{index}")
    fields: dict[str, Any] = {
        "messages": messages,
        "continue_final_message": request.messages[-1].role == "assistant",
        **_tool_fields(request),
    }
    if isinstance(request.thinking, ThinkingDisabled):
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    if isinstance(request, MessagesRequest):
        fields |= {"max_tokens": request.max_tokens, "stop": request.stop_sequences,
                   "temperature": request.temperature, "top_p": request.top_p,
                   "top_k": request.top_k, "stream": request.stream}
    return ChatCompletionRequest.model_validate(fields)


def _system(system: str | list[TextBlockParam] | None) -> list[dict[str, Any]]:
    if not system:
        return []
    content = system if isinstance(system, str) else [b.model_dump() for b in system]
    return [{"role": "system", "content": content}]


def _tool_fields(request: CountTokensRequest) -> dict[str, Any]:
    if not request.tools:
        return {}
    choice = request.tool_choice
    single = bool(choice and getattr(choice, "disable_parallel_tool_use", False))
    return {"tools": [_function(tool) for tool in request.tools],
            "tool_choice": _chat_tool_choice(choice),
            "parallel_tool_calls": False if single else None}


def _chat_tool_choice(choice: ToolChoice | None) -> Any:
    if isinstance(choice, ToolChoiceTool):
        return {"type": "function", "function": {"name": choice.name}}
    return "required" if choice and choice.type == "any" else (choice.type if choice else "auto")


def _function(tool: AnthropicTool) -> dict[str, Any]:
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _converted(message: MessageParam, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (a user's tool results are messages of their
    own)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict[str, Any]] = []
    texts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        _check_block(block, message.role, f"{where}.content.{j}")
        if isinstance(block, ThinkingBlockParam):
            continue  # earlier thinking: not part of a later turn's prompt
        if isinstance(block, TextBlockParam):
            texts.append(block.model_dump())
        elif isinstance(block, MediaBlockParam):  # an image: chat's image_url part
            texts.append(_image_part(block, f"{where}.content.{j}"))
        elif isinstance(block, ToolUseBlockParam):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": arguments}})
        else:  # a tool result, after the text before it
            if texts:
                out.append({"role": "user", "content": texts})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _result_text(block)})
    if message.role == "assistant":
        return [{"role": "assistant", "content": texts, "tool_calls": calls or None}]
    return out + [{"role": "user", "content": texts}] if texts or not out else out


def _image_part(block: MediaBlockParam, where: str) -> dict[str, Any]:
    """An image block as chat's `image_url` part: a base64 source as a data: URL."""
    source = block.source or {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        media_type = source.get("media_type")
        if media_type not in IMAGE_TYPES:
            raise AnthropicError(f"{where}.source.media_type: one of {', '.join(IMAGE_TYPES)}")
        url = f"data:{media_type};base64,{source['data']}"
    elif source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise AnthropicError(f"{where}.source: a base64 source (media_type, data) or a url "
                             "source (url)")
    return {"type": "image_url", "image_url": {"url": url}, "_where": where, "_type": "image"}


IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def _check_block(block: Any, role: str, where: str) -> None:
    kind = block.type
    if kind == "document":
        raise AnthropicError(f"{where}.type: document content is not supported")
    if kind == "image" and role != "user":
        raise AnthropicError(f"{where}.type: image blocks belong in user messages")
    owner = {"tool_use": "assistant", "tool_result": "user"}.get(kind, role)
    if owner != role:
        raise AnthropicError(f"{where}.type: {kind} blocks belong in {owner} messages")


def _result_text(block: ToolResultBlockParam) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    return "\n".join(part.text for part in block.content)
