"""The chat request as pydantic models: OpenAI's chat completion body, which every chat-shaped
protocol runs as (Anthropic's Messages and the Responses API convert their bodies into it; vLLM's
`/tokenize` renders its messages and tools), and the fields it shares with OpenAI's completions.

Every OpenAI field, plus the extensions of vLLM and of MindIE's OpenAI-compatible chat API:
`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`, `ignore_eos`, chat's `echo` /
`continue_final_message` / `add_generation_prompt`. Optional fields accept null (= the default),
as MindIE documents. Unknown fields are ignored and logged, as vLLM does (OpenAI itself rejects
them): clients such as LangChain send provider-specific extras. Ranges are OpenAI's where it has
one, else MindIE's.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; vLLM's default max_logprobs for completions
MAX_TOOLS = 32  # as Databricks allows
MAX_STOP_CHARS = 32 * 1024  # stop strings in all (MindIE's chat API)

Probability = Annotated[float, Field(gt=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
StopString = Annotated[str, Field(min_length=1)]


def _object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters describe its arguments, an object, as OpenAI and Anthropic
    require: a call's arguments are never another JSON value."""
    kind = schema.get("type", "object")
    if kind != "object":
        raise ValueError(f'a function\'s parameters must be a JSON schema of type "object" '
                         f"(got type {json.dumps(kind)})")
    return schema


# A tool's `parameters` (Anthropic's `input_schema`).
ObjectSchema = Annotated[dict[str, Any], AfterValidator(_object_schema)]


class _Lenient(BaseModel):
    """Nested objects: unknown keys ignored (OpenAI adds fields over time)."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool | None = None


class FunctionCall(_Lenient):
    name: str
    arguments: str


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string or a list of content parts (checked in `chat_prompt`, which knows the model).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: ObjectSchema | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(_Lenient):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class GenerationFields(BaseModel):
    """The fields chat and completions share."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str | None = None
    n: int = Field(1, ge=1, le=128)  # null is 1 (see `_null_n`)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    ignore_eos: bool | None = False
    max_tokens: int | None = Field(None, ge=1, lt=2**31)
    min_tokens: int | None = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**64)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: Probability | None = None
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    user: str | None = None

    @field_validator("n", mode="before")
    @classmethod
    def _null_n(cls, value: Any) -> Any:
        return 1 if value is None else value

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    @property
    def max_output_tokens(self) -> tuple[str, int | None]:
        """The field that caps the output, and its value."""
        return "max_tokens", self.max_tokens

    @property
    def truncates(self) -> bool:
        """Whether a prompt or output over the context is cut to fit rather than refused."""
        return False


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, lt=2**31)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions for prefilling the answer: `continue_final_message` leaves the last
    # (assistant) message open for the model to continue, instead of opening a new one; `echo`
    # puts that message's text before the answer's. `add_generation_prompt` defaults to the
    # opposite of `continue_final_message`.
    echo: bool | None = False
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = False
    # vLLM's: more variables for the chat template (`enable_thinking: false` switches a
    # reasoning model's thinking off where its template reads it).
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=64)
    # vLLM's: at most this many tokens of thinking, then its end is written (a reasoning parser)
    thinking_token_budget: int | None = Field(None, ge=0, lt=2**31)

    @property
    def thinking(self) -> bool:
        """Whether the model may think: not where `enable_thinking` is false."""
        return (self.chat_template_kwargs or {}).get("enable_thinking") is not False

    @property
    def max_output_tokens(self) -> tuple[str, int | None]:
        """`max_completion_tokens` (OpenAI's newer name) wins over `max_tokens`."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens
