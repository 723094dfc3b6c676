"""The Responses API's request body (`POST /v1/responses`) as pydantic models.

Shapes are the openai SDK's `ResponseCreateParams`; validation errors name the field as OpenAI
spells it (`input[1].content[0].text`). Items and tools of a type this server cannot serve
(reasoning items, built-in tools...) still parse, as `OtherInputItem` / `OtherTool`, so that `parse`
refuses them by name rather than as a union mismatch. Unknown top-level fields are ignored and
logged, as on the chat route. Besides OpenAI's sampling fields, vLLM's extensions (`seed`,
`top_k`, `min_p`, `repetition_penalty`) and chat's penalties are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from handlers.protocols.chat.requests import (
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    ObjectSchema,
    Penalty,
    Probability,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# OpenAI's `include` values; all but logprobs ask for parts of items this server never outputs.
INCLUDABLE = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs", "reasoning.encrypted_content", LOGPROBS_INCLUDE})


class _Lenient(BaseModel):
    """Nested objects: unknown keys ignored (OpenAI adds fields over time; items sent back as
    they were received carry `id`, `status`...)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class InputContentPart(_Lenient):
    """`input_text` / `output_text` (`text`), `refusal`, `input_image` (`image_url`: a URL or
    a data: URL; `file_id` is refused) or `input_audio` (`data`, `format`); others are refused
    in `items`."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None
    input_audio: dict[str, Any] | None = None


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputContentPart]


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputContentPart]


def _other(*kinds: str) -> Any:
    """The `type` of an item, tool or choice this server refuses (documented as such)."""
    return Field(json_schema_extra={"not": {"enum": list(kinds)}})


class OtherInputItem(_Lenient):
    type: str = _other("message", "function_call", "function_call_output")


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message" if "role" in value else None) \
        if isinstance(value, dict) else getattr(value, "type", None)
    # Tags are CamelCase so that error paths leave them out (chat/errors.py, param_path).
    return {"message": "Message", "function_call": "FunctionCall",
            "function_call_output": "FunctionCallOutput"}.get(kind, "Other")


InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")] | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")]
    | Annotated[OtherInputItem, Tag("Other")],
    Discriminator(_item_kind)]


class FunctionTool(_Lenient):
    """The Responses API's flat function tool (chat nests the same under `function`)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: ObjectSchema | None = None
    strict: bool | None = None


class OtherTool(_Lenient):
    type: str = _other("function")


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "Function" if kind == "function" else "Other"


ResponsesTool = Annotated[
    Annotated[FunctionTool, Tag("Function")] | Annotated[OtherTool, Tag("Other")],
    Discriminator(_tool_kind)]


class FunctionToolChoice(_Lenient):
    type: Literal["function"]
    name: str


class OtherToolChoice(_Lenient):
    type: str = _other("function")


ToolChoice = Annotated[
    Annotated[FunctionToolChoice, Tag("Function")] | Annotated[OtherToolChoice, Tag("Other")],
    Discriminator(_tool_kind)]


class ResponseTextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseTextConfig(_Lenient):
    format: ResponseTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, lt=2**31)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: Probability | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = None
    text: ResponseTextConfig | None = None
    tools: list[ResponsesTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    store: bool | None = True
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    # What this server cannot do; `parse` refuses them when set (they parse to be named).
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # vLLM's sampling extensions, and chat's penalties
    seed: int | None = Field(None, ge=0, lt=2**64)
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])
