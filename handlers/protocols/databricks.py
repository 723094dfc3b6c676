"""Databricks' serving endpoints: `POST /serving-endpoints/{model}/invocations` answers chat,
completions or embeddings, whichever the body asks for, in OpenAI's shapes (Databricks' own
fields ride on OpenAI's request models). An endpoint serves one model, so its task must be one
that model does: an embedding model's endpoint embeds, an LLM's chats and completes.
"""

from __future__ import annotations

from typing import Any

from handlers.protocols.chat.errors import OpenAIError

# The body key that names each task, in the order a body is tried.
TASK_KEYS = {"messages": "chat", "prompt": "completions", "input": "embeddings"}


def task_key(body: Any) -> str:
    """The key of the task the body asks for; a 400 when it asks for none."""
    if isinstance(body, dict):
        for key in TASK_KEYS:
            if key in body:
                return key
    raise OpenAIError("the body must carry 'messages' (chat), 'prompt' (completions) or "
                      "'input' (embeddings)", None)


def check_endpoint_task(endpoint: str, key: str, embedding_model: str | None) -> None:
    """Refuse (400) a task the endpoint's model does not do."""
    embeds = endpoint == embedding_model
    if embeds == (TASK_KEYS[key] == "embeddings"):
        return
    does = ("embeddings (a body with 'input')" if embeds
            else "chat ('messages') and completions ('prompt')")
    raise OpenAIError(f"{key}: the endpoint '{endpoint}' serves {does}, not {TASK_KEYS[key]}",
                      key, code="invalid_value")
