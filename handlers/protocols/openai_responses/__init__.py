"""OpenAI's Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`), over the
chat machinery (handlers/protocols/chat/): input items become chat messages (`items`), the
request a chat request (`prepare`: the same template, tool prompt, sampling and constrained
decoding), and the engine's outputs response objects and stream events (`render`, and `events`:
the driver's renderer); `store` keeps responses for retrieval and `previous_response_id`.
`requests` / `parse` validate the body and refuse what this server cannot do by field.
"""

from handlers.protocols.openai_responses.events import ResponsesEvents
from handlers.protocols.openai_responses.prepare import ResponsesJob, prepare_response
from handlers.protocols.openai_responses.render import ResponsesStream
from handlers.protocols.openai_responses.requests import ResponsesRequest
from handlers.protocols.openai_responses.store import ResponseStore, Stored, not_found

__all__ = ["ResponseStore", "ResponsesEvents", "ResponsesJob", "ResponsesRequest",
           "ResponsesStream", "Stored", "not_found", "prepare_response"]
