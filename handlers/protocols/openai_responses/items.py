"""Input items -> chat messages, so the Responses API renders its prompt exactly as chat does.

- `instructions` and every system / developer message become the one leading system message
  (joined in order): chat templates take a system message first only, and a conversation
  continued with `previous_response_id` may carry system messages of earlier turns.
- user and assistant messages keep their role; their content is a string or text parts
  (`input_text`, `output_text`, `refusal`), and in user messages `input_image` and
  `input_audio`, handed to chat as `image_url` and `input_audio` parts (a text-only model
  refuses them there); files are refused.
- `function_call` items become the assistant's tool calls (joined onto the assistant message
  they follow), and `function_call_output` items tool messages, each answering an earlier call.
- `reasoning` items (a reasoning model's earlier thinking, given back or stored) are dropped
  where the server splits thinking off (a later turn's prompt holds no earlier thinking, as
  reasoning models' chat templates render it), and refused elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from handlers.protocols.chat.errors import OpenAIError
from handlers.protocols.openai_responses.requests import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputContentPart,
    MessageItem,
    OtherInputItem,
)

Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | OtherInputItem
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio"})


def chat_messages(instructions: str | None, items: Sequence[Item], first_new: int,
                  reasons: bool = False) -> list[dict[str, Any]]:
    """The chat messages of a conversation: `items[first_new:]` are this request's input
    (named `input[i]` in errors), those before it the stored history; `reasons`: reasoning
    items are known (option.reasoning_parser)."""
    system = [instructions] if instructions else []
    messages: list[dict[str, Any]] = []
    calls: set[str] = set()
    for i, item in enumerate(items):
        where = f"input[{i - first_new}]"
        if isinstance(item, MessageItem):
            if item.role == "user" and _has_media(item.content):
                messages.append({"role": "user",
                                 "content": chat_parts(item.content, f"{where}.content")})
                continue
            text = content_text(item.content, f"{where}.content")
            if item.role in ("system", "developer"):
                system.append(text)
            else:
                messages.append({"role": item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
            _add_call(messages, item)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(_call_output(item, where, calls))
        elif not (reasons and item.type == "reasoning"):
            raise _unsupported_item(item, where)
    if not messages:
        raise OpenAIError("input: needs at least one message besides system and developer "
                          "ones", "input", code="missing_required_parameter")
    return [{"role": "system", "content": "\n\n".join(system)}, *messages] if system \
        else messages


def _add_call(messages: list[dict[str, Any]], item: FunctionCallItem) -> None:
    call = {"id": item.call_id, "type": "function",
            "function": {"name": item.name, "arguments": item.arguments}}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_output(item: FunctionCallOutputItem, where: str, calls: set[str]) -> dict[str, Any]:
    if item.call_id not in calls:
        raise OpenAIError(f"{where}.call_id: no function_call item with call_id "
                          f"{item.call_id!r} comes before this output", f"{where}.call_id",
                          code="invalid_value")
    return {"role": "tool", "tool_call_id": item.call_id,
            "content": content_text(item.output, f"{where}.output")}


def _unsupported_item(item: OtherInputItem, where: str) -> OpenAIError:
    what = "this model produces no reasoning items" if item.type == "reasoning" else \
        "only message, function_call and function_call_output items are supported"
    return OpenAIError(f"{where}.type: {item.type!r} items are not supported: {what}",
                       f"{where}.type", code="unsupported_value")


def _has_media(content: str | list[InputContentPart]) -> bool:
    return not isinstance(content, str) and any(p.type in CHAT_MEDIA for p in content)


CHAT_MEDIA = frozenset({"input_image", "input_audio"})


def chat_parts(content: list[InputContentPart], param: str) -> list[dict[str, Any]]:
    """A user message's parts as chat's: text, `image_url`, `input_audio` (each `_where`
    naming the part here)."""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if part.type == "input_image":
            if part.image_url is None:
                raise OpenAIError(f"{where}.image_url: required (file_id is not supported: "
                                  "this server stores no files)", f"{where}.image_url",
                                  code="missing_required_parameter")
            parts.append({"type": "image_url", "image_url": {"url": part.image_url},
                          "_where": where, "_type": part.type})
        elif part.type == "input_audio":
            parts.append({"type": "input_audio", "input_audio": part.input_audio,
                          "_where": where, "_type": part.type})
        else:
            parts.append({"type": "text", "text": _part_text(part, where), "_where": where})
    return parts


def content_text(content: str | list[InputContentPart], param: str) -> str:
    """A string, or the text parts joined by newlines (`param`: where the content is)."""
    if isinstance(content, str):
        return content
    return "\n".join(_part_text(part, f"{param}[{j}]") for j, part in enumerate(content))


def _part_text(part: InputContentPart, param: str) -> str:
    if part.type in MEDIA_PARTS:
        raise OpenAIError(f"{param}.type: this model is text-only; {part.type} content is not "
                          "supported", f"{param}.type", code="unsupported_value")
    if part.type not in TEXT_PARTS and part.type != "refusal":
        raise OpenAIError(f"{param}.type: must be input_text, output_text or refusal (got "
                          f"{part.type!r})", f"{param}.type", code="invalid_value")
    text = part.refusal if part.type == "refusal" else part.text
    if text is None:
        key = "refusal" if part.type == "refusal" else "text"
        raise OpenAIError(f"{param}.{key}: a {part.type} part needs {key!r}", f"{param}.{key}",
                          code="missing_required_parameter")
    return text
