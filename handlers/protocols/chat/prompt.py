"""Chat messages -> the prompt text, through the model's own chat template.

Roles: system (only as the first message; OpenAI's `developer` is its alias), user, assistant,
tool (which must carry `tool_call_id`). Content is a string or a list of parts: text, and for
a multimodal model (its tokenizer has a `media` reader) `image_url`, `input_audio`, `video_url`
and `audio_url` (chat_media.py reads them); a text-only model refuses media parts (400).

Tools are offered through the template's `tools` argument when the template renders them; a
template that ignores them (SmolLM2's does) gets them in the system message instead, in the
format `tool_calls.TOOL_PROMPT` documents, and past assistant tool calls as that format's text.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta

from handlers.engine.base import Tokenizer
from handlers.protocols.chat import tool_calls
from handlers.protocols.chat.chat_media import MEDIA_PARTS, MediaParts, PendingMedia
from handlers.protocols.chat.errors import OpenAIError
from handlers.protocols.chat.requests import ChatCompletionRequest, ChatMessage


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    media: PendingMedia | None = None  # in the order of their placeholders in `text`

    def request_media(self) -> dict[str, Any]:
        """A GenerationRequest's media fields: the parts the server reads before validation."""
        return {} if self.media is None else {"pending_media": self.media.read}


def media_prompt_ids(tokenizer: Tokenizer, prompt: ChatPrompt) -> list[int]:
    """A prompt with media as the model's processor tokenizes it, its media's tokens counted
    (the media read here: /tokenize and count_tokens)."""
    assert prompt.media is not None
    items = prompt.media.read_here()
    try:
        return tokenizer.encode_media_prompt(prompt.text, items)
    except (ValueError, TypeError) as exc:
        raise OpenAIError(f"messages: the model's processor refused the media: {exc}",
                          "messages", code="invalid_value") from None


def render_chat_prompt(tokenizer: Tokenizer, request: ChatCompletionRequest) -> ChatPrompt:
    """The prompt of a conversation; media parts checked and counted where the model takes them
    (read later: `ChatPrompt.media`)."""
    tools = offered_tools(request)
    template = _template(tokenizer, tools)
    uses = template_variables(template)
    knows_calls = "tool_calls" in template
    media = MediaParts(tokenizer.media)
    messages = [_message(m, i, knows_calls, media) for i, m in enumerate(request.messages)]
    if tools and "tools" not in uses:
        messages = tool_calls.with_tool_prompt(messages, tools)
    pending = media.pending()
    if media.reader is not None:  # multimodal templates read content as a list of parts
        messages = [{**m, "content": _parts(m["content"])} for m in messages]
    try:
        text = tokenizer.render_chat(template, messages, tools=tools if "tools" in uses else None,
                                     variables=_variables(request), **_prompt_end(request))
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        raise OpenAIError(f"messages: the model's chat template cannot render them: {exc}",
                          "messages") from None
    return ChatPrompt(text, pending)


# What the rendering itself passes: chat_template_kwargs cannot set them.
_RESERVED = frozenset({"messages", "tools", "chat_template", "tokenize", "add_generation_prompt",
                       "continue_final_message", "documents", "return_dict"})


def _variables(request: ChatCompletionRequest) -> dict[str, Any]:
    variables = request.chat_template_kwargs or {}
    for name in variables:
        if name in _RESERVED:
            raise OpenAIError(f"chat_template_kwargs.{name}: set by the request's own fields, "
                              "not here", f"chat_template_kwargs.{name}", code="invalid_value")
    return variables


def _prompt_end(request: ChatCompletionRequest) -> dict[str, bool]:
    """How the prompt ends: opening the assistant's answer (the default), or continuing the
    last message (vLLM's `continue_final_message`, to prefill the answer)."""
    continues = bool(request.continue_final_message)
    opens = request.add_generation_prompt
    opens = not continues if opens is None else opens
    return {"add_generation_prompt": opens, "continue_final_message": continues}


def echoed_text(request: ChatCompletionRequest) -> str:
    """With `echo`, the last message's text when it is the assistant's (vLLM's rule): the
    answer continues it, so the response starts with it."""
    last = request.messages[-1]
    if not request.echo or last.role != "assistant":
        return ""
    return content_text(last.content, f"messages[{len(request.messages) - 1}]")


def offered_tools(request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the template sees them; none when `tool_choice` is "none"."""
    if not request.tools or request.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in request.tools]


def _template(tokenizer: Tokenizer, tools: list[dict[str, Any]] | None) -> str:
    """The chat template in effect (option.chat_template, else the model's own)."""
    try:
        return tokenizer.chat_template(tools)
    except ValueError:
        raise OpenAIError("messages: this model has no chat template; use /v1/completions "
                          "with a prompt instead", "messages") from None


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The names a chat template reads from its context (e.g. whether it renders `tools`)."""
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError:  # a tag of transformers' own ({% generation %}): guess by name
        return frozenset(name for name in ("tools",) if name in template)


def _message(message: ChatMessage, index: int, template_has_tool_calls: bool,
             media: MediaParts) -> dict[str, Any]:
    where = f"messages[{index}]"
    role = "system" if message.role == "developer" else message.role
    if role == "system" and index > 0:
        raise OpenAIError(f"{where}.role: a system message may only come first",
                          f"{where}.role", code="invalid_value")
    if role == "tool" and not message.tool_call_id:
        raise OpenAIError(f"{where}.tool_call_id: required for a tool message",
                          f"{where}.tool_call_id", code="missing_required_parameter")
    if message.content is None and not (role == "assistant" and message.tool_calls):
        raise OpenAIError(f"{where}.content: required for a {message.role} message",
                          f"{where}.content", code="missing_required_parameter")
    out: dict[str, Any] = {"role": role, "content": media.content(message.content, where, role)
                           if media.reader else content_text(message.content, where)}
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.name:
        out["name"] = message.name
    if message.tool_calls:
        calls = [tool_calls.template_call(c) for c in message.tool_calls]
        if template_has_tool_calls:
            out["tool_calls"] = calls
        else:
            out["content"] = tool_calls.append_calls_text(out["content"], calls)
    return out


def _parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


def content_text(content: str | list[dict[str, Any]] | None, where: str) -> str:
    """A message's text: the string, or its text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        param = part.get("_where") or f"{where}.content[{j}]"
        kind = part.get("type")
        if isinstance(kind, str) and kind in MEDIA_PARTS:
            label = part.get("_type") or kind
            raise OpenAIError(f"{param}.type: this model is text-only; {label} content is not "
                              "supported", f"{param}.type", code="invalid_value")
        if kind != "text":
            raise OpenAIError(f"{param}.type: must be 'text' (got {kind!r})", f"{param}.type",
                              code="invalid_value")
        if not isinstance(part.get("text"), str):
            raise OpenAIError(f"{param}.text: a text part needs a string 'text'",
                              f"{param}.text", code="invalid_type")
        texts.append(part["text"])
    return "\n".join(texts)
