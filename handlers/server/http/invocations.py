"""SageMaker's and DJL LMI's entry: `POST /invocations` and `POST /predictions/{model}`.

Which protocol a body speaks is decided here, once (`body_handler`); the SageMaker runtime
routes answer through it too. A JSON object is, in this order:

1. an Anthropic Messages request when it has `messages` and says so: the `anthropic-version`
   header (every Anthropic SDK sends it), an `anthropic_version` field (as Bedrock and Vertex AI
   bodies carry), a top-level `system`, or a content block of type `tool_use` or `tool_result`
   (an OpenAI chat body has none of these);
2. an OpenAI chat completion when it has `messages`;
3. an OpenAI Responses request when it has `input`, a generation model is served, its `model`
   is not the embedding model's name, and: its `model` is the generation model's name (or
   one of its LoRA adapters'), or it has a field of `RESPONSES_FIELDS` (none is an embeddings
   field), or no embedding model is served;
4. a completion when it has `prompt`;
5. embeddings when it has `input`;
6. else LMI's schema, as anything that is not an object.

Databricks' endpoints choose among OpenAI's chat, completions and embeddings by the keys of
`BODY_ROUTES` alone.

SageMaker's adapter header (`X-Amzn-SageMaker-Adapter-Identifier`) names the LoRA adapter
whatever the body speaks: it sets the body's own selector, over what the body says (as vLLM's
SageMaker integration sets `model`, and DJL LMI reads the header before `adapters`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response

from handlers.protocols.anthropic import VERSION_HEADER
from handlers.protocols.errors import ErrorKind
from handlers.server.context import ServerContext
from handlers.server.framing import Answer
from handlers.server.http.answers import to_response
from handlers.server.http.anthropic import messages_body
from handlers.server.http.embeddings import embeddings_body
from handlers.server.http.guard import read_then
from handlers.server.http.lmi import LMI, lmi_body
from handlers.server.http.openai import BodyHandler, chat_body, completion_body
from handlers.server.http.responses_api import create_body as responses_body

BODY_ROUTES: tuple[tuple[str, BodyHandler], ...] = (
    ("messages", chat_body),
    ("prompt", completion_body),
    ("input", embeddings_body),
)
ANTHROPIC_ONLY_BLOCKS = frozenset({"tool_use", "tool_result"})
ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"
# Fields of a Responses request that no embeddings request has.
RESPONSES_FIELDS = frozenset({
    "instructions", "max_output_tokens", "previous_response_id", "conversation", "text",
    "tools", "tool_choice", "parallel_tool_calls", "store", "reasoning", "stream",
    "temperature", "top_p", "metadata", "include", "truncation", "background"})


def body_handler(ctx: ServerContext, body: Any, headers: Headers) -> BodyHandler:
    """The handler of the protocol a decoded body speaks (the module's docstring says how)."""
    if not isinstance(body, dict):
        return lmi_body
    if "messages" in body:
        return messages_body if is_anthropic(body, headers) else chat_body
    if is_responses(ctx, body, headers.get(ADAPTER_HEADER)):
        return responses_body
    return next((handler for key, handler in BODY_ROUTES if key in body), lmi_body)


def is_anthropic(body: dict[str, Any], headers: Headers) -> bool:
    """Whether a body with `messages` is Anthropic's rather than OpenAI's chat."""
    return (VERSION_HEADER in headers or "anthropic_version" in body
            or "system" in body or _has_anthropic_blocks(body["messages"]))


def _has_anthropic_blocks(messages: Any) -> bool:
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
                isinstance(block, dict) and isinstance(block.get("type"), str)
                and block["type"] in ANTHROPIC_ONLY_BLOCKS for block in content):
            return True
    return False


def is_responses(ctx: ServerContext, body: dict[str, Any], adapter: str | None = None) -> bool:
    """Whether a body is a Responses request for the generation model rather than embeddings
    (`adapter`: what SageMaker's adapter header names, which stands for the body's `model`)."""
    if "input" not in body or ctx.generator is None:
        return False
    model = adapter if adapter is not None else body.get("model")
    if model is not None and model == ctx.embedding_model():
        return False
    return model == ctx.settings.model_name or model in ctx.adapters() \
        or not RESPONSES_FIELDS.isdisjoint(body) or ctx.embedder is None


def with_adapter(body: Any, handler: BodyHandler, headers: Headers) -> Any:
    """The body with SageMaker's adapter header in its protocol's selector: LMI's `adapters`,
    every other protocol's `model` (so an embeddings body naming an adapter is a 404)."""
    adapter = headers.get(ADAPTER_HEADER)
    if adapter is None or not isinstance(body, dict):
        return body
    return {**body, "adapters" if handler is lmi_body else "model": adapter}


async def invoke(ctx: ServerContext, request: Request) -> Answer:
    """Answer an invocation body, whichever protocol it speaks (one that cannot be read is
    refused in LMI's shape)."""
    async def answer(body: Any) -> Answer:
        handler = body_handler(ctx, body, request.headers)
        return await handler(ctx, request, with_adapter(body, handler, request.headers))

    return await read_then(LMI, request, ctx.settings.max_request_size, answer)


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()

    @routes.post("/invocations")
    async def invocations(request: Request) -> Response:
        return to_response(await invoke(ctx, request))

    @routes.post("/predictions/{model}")
    async def predictions(model: str, request: Request) -> Response:
        served = ctx.settings.model_name
        if model != served:
            message = f"model '{model}' not found; this server serves '{served}'"
            return to_response(LMI.error(message, ErrorKind.NOT_FOUND))
        return to_response(await invoke(ctx, request))

    return routes
