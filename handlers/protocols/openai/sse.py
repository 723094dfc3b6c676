"""Server-sent events as OpenAI streams them: `data: {json}` events, then `data: [DONE]`.

An error after the stream began is one more event, `data: {"error": {...}}`, before `[DONE]`.
"""

from __future__ import annotations

from typing import Any

import orjson

from handlers.protocols.openai.errors import OpenAIError

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"


def sse_event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def stream_error(message: str) -> bytes:
    return sse_event(OpenAIError(message, status=500).payload())
