"""OpenAI protocol: chat completions, completions and embeddings (vLLM's, MindIE's and
Databricks' extensions included).

Chat's request, prompt, sampling, tool calls, constrained decoding, admission checks and error
shape are what chat-shaped protocols share (handlers/protocols/chat/). Modules here: `requests`
(the completions model), `parse` (cross-field checks), `prepare` (body -> engine requests),
`accumulate` / `logprobs` / `chat_render` / `completion_render` (answers from engine outputs,
pure), `events` (the driver's stream renderers), `embeddings`.
"""

from handlers.protocols.openai.chat_render import ChatStream, render_chat_completion
from handlers.protocols.openai.completion_render import (
    CompletionOptions,
    CompletionStream,
    render_completion,
)
from handlers.protocols.openai.events import chat_events, completion_events
from handlers.protocols.openai.prepare import (
    ChatJob,
    CompletionJob,
    prepare_chat,
    prepare_completion,
)

__all__ = [
    "ChatJob",
    "ChatStream",
    "CompletionJob",
    "CompletionOptions",
    "CompletionStream",
    "chat_events",
    "completion_events",
    "prepare_chat",
    "prepare_completion",
    "render_chat_completion",
    "render_completion",
]
