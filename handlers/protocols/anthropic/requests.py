"""Anthropic Messages request bodies as pydantic models (`POST /v1/messages`, `count_tokens`).

Anthropic's fields and ranges (temperature 0..1; `max_tokens` required to create a message).
Unknown fields are ignored, as the OpenAI models here ignore theirs; `model` may be omitted, as a
body sent through Bedrock or SageMaker carries no model (its `anthropic_version` says what it
speaks). Content blocks are told apart by `type`; image and document blocks parse, so that the
refusal can say the model is text-only.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from handlers.protocols.chat.requests import MAX_TOOLS, ObjectSchema, StopString

VERSION_HEADER = "anthropic-version"  # every Anthropic SDK sends it: the request is Anthropic's


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlockParam(_Lenient):
    type: Literal["text"]
    text: str


class ToolUseBlockParam(_Lenient):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlockParam(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlockParam] | None = None
    is_error: bool | None = None


class MediaBlockParam(_Lenient):
    type: Literal["image", "document"]
    source: dict[str, Any] | None = None


class ThinkingBlockParam(_Lenient):
    """A past answer's thinking, as the SDKs send it back (dropped: the prompt of a later turn
    holds no earlier thinking, as reasoning models' chat templates render it)."""

    type: Literal["thinking", "redacted_thinking"]


ContentBlockParam = Annotated[
    TextBlockParam | ToolUseBlockParam | ToolResultBlockParam | MediaBlockParam
    | ThinkingBlockParam, Field(discriminator="type")]


class MessageParam(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class AnthropicTool(_Lenient):
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search...) are not here
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: ObjectSchema


class ToolChoiceAuto(_Lenient):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_Lenient):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_Lenient):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_Lenient):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
                       Field(discriminator="type")]


class ThinkingEnabled(_Lenient):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024, lt=2**31)


class ThinkingDisabled(_Lenient):
    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled, Field(discriminator="type")]


class AnthropicMetadata(_Lenient):
    user_id: str | None = None


class CountTokensRequest(_Lenient):
    """What renders the prompt: `count_tokens` reads only this."""

    model: str | None = None
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    # Extended thinking: `disabled` switches a reasoning model's thinking off in its template.
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, lt=2**31)
    stop_sequences: list[StopString] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, lt=2**31)
    metadata: AnthropicMetadata | None = None
    stream: bool | None = False
    anthropic_version: str | None = None  # Bedrock's and Vertex AI's way to name the API
