"""OpenAI protocol: chat completions, completions and embeddings (vLLM's, MindIE's and
Databricks' extensions included).

Modules: `requests` (pydantic models), `parse` (cross-field checks), `params` (to
SamplingParams), `chat_prompt` (chat template), `tool_calls` (the tool-call text format and its
parser), `structured` (constrained-decoding specs), `prepare` (body -> engine requests),
`admit` (its checks: refusals in its terms, the output length), `accumulate` / `logprobs` /
`chat_render` / `completion_render` / `events` (answers from engine outputs, pure),
`embeddings`, `errors`.
"""

from handlers.protocols.openai.accumulate import ResponseContext
from handlers.protocols.openai.admit import checks
from handlers.protocols.openai.chat_render import ChatOptions, ChatStream, render_chat_completion
from handlers.protocols.openai.completion_render import (
    CompletionOptions,
    CompletionStream,
    render_completion,
)
from handlers.protocols.openai.errors import (
    OpenAIError,
    generation_failed,
    model_not_found,
    not_a_text_model,
)
from handlers.protocols.openai.events import chat_events, completion_events
from handlers.protocols.openai.prepare import (
    ChatJob,
    CompletionJob,
    check_model,
    prepare_chat,
    prepare_completion,
)

__all__ = [
    "ChatJob",
    "ChatOptions",
    "ChatStream",
    "CompletionJob",
    "CompletionOptions",
    "CompletionStream",
    "OpenAIError",
    "ResponseContext",
    "chat_events",
    "checks",
    "completion_events",
    "check_model",
    "generation_failed",
    "model_not_found",
    "not_a_text_model",
    "prepare_chat",
    "prepare_completion",
    "render_chat_completion",
    "render_completion",
]
