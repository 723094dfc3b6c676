"""OpenAI protocol: chat completions and completions (vLLM's and MindIE's extensions included).

Modules: `requests` (pydantic models), `parse` (cross-field checks), `params` (to
SamplingParams), `chat_prompt` (chat template), `tool_calls` (the tool-call text format and its
parser), `structured` (constrained-decoding specs), `prepare` (body -> engine requests),
`accumulate` / `logprobs` / `chat_render` / `completion_render` (answers from engine outputs,
pure), `errors`, `sse`.
"""

from handlers.protocols.openai.accumulate import Collected, ResponseContext, failure
from handlers.protocols.openai.chat_render import ChatOptions, ChatStream, render_chat_completion
from handlers.protocols.openai.completion_render import (
    CompletionOptions,
    CompletionStream,
    render_completion,
)
from handlers.protocols.openai.errors import OpenAIError, model_not_found, not_a_text_model
from handlers.protocols.openai.params import engine_refusal, fit_to_context
from handlers.protocols.openai.prepare import (
    ChatJob,
    CompletionJob,
    check_model,
    prepare_chat,
    prepare_completion,
)
from handlers.protocols.openai.sse import DONE, sse_event, stream_error

__all__ = [
    "DONE",
    "ChatJob",
    "ChatOptions",
    "ChatStream",
    "Collected",
    "CompletionJob",
    "CompletionOptions",
    "CompletionStream",
    "OpenAIError",
    "ResponseContext",
    "check_model",
    "engine_refusal",
    "failure",
    "fit_to_context",
    "model_not_found",
    "not_a_text_model",
    "prepare_chat",
    "prepare_completion",
    "render_chat_completion",
    "render_completion",
    "sse_event",
    "stream_error",
]
