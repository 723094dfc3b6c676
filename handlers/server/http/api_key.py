"""The API key over HTTP: a pure ASGI middleware (streams and disconnects pass untouched) that
answers 401 to a request without the key (`Authorization: Bearer` or `x-api-key`): in
Anthropic's error shape under `/v1/messages` or with an `anthropic-version` header, in OpenAI's
elsewhere under `/v1/` and on `/tokenize` / `/detokenize`, else as `{"error": ...}`. Health,
liveness, metrics and the API documents stay open, as vLLM leaves them, so probes and scrapers
need no key; so do the page's files, which hold nothing of the server's and ask for the key."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from handlers.protocols.anthropic import VERSION_HEADER, error_body
from handlers.protocols.chat.errors import OpenAIError
from handlers.protocols.errors import KServeError
from handlers.server.api_key import UNAUTHORIZED, ApiKey
from handlers.server.framing import Reply
from handlers.server.http.answers import json_response
from handlers.server.ui.page import is_page

OPEN_PATHS = frozenset({"/ping", "/health", "/v2/health/live", "/v2/health/ready", "/metrics",
                        "/openapi.json", "/docs", "/redoc"})
_OPEN_ROOT_METHODS = ("GET", "HEAD")  # `GET /` is TGI's health; `POST /` generates
ANTHROPIC_PATHS = ("/v1/messages",)
OPENAI_PATHS = ("/v1/", "/tokenize", "/detokenize")  # vLLM's tokenizer routes: OpenAI's shape


def is_open(method: str, path: str) -> bool:
    if path == "/":
        return method in _OPEN_ROOT_METHODS
    return path in OPEN_PATHS or path.startswith("/docs/") or is_page(method, path)


def refusal(path: str, headers: Headers) -> Reply:
    """The 401 in the shape of the protocol the request speaks, as far as its path and headers
    tell (the body is not read)."""
    answer_headers = {"WWW-Authenticate": "Bearer"}
    if path.startswith(ANTHROPIC_PATHS) or VERSION_HEADER in headers:
        return Reply(401, error_body(401, UNAUTHORIZED), answer_headers)
    if path.startswith(OPENAI_PATHS):
        error = OpenAIError(UNAUTHORIZED, code="invalid_api_key")
        return Reply(401, error.payload(401), answer_headers)
    return Reply(401, KServeError(UNAUTHORIZED).payload(401), answer_headers)


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = ApiKey(key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_open(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.key.accepts(headers.get("authorization"), headers.get("x-api-key")):
            await self.app(scope, receive, send)
            return
        await json_response(refusal(scope["path"], headers))(scope, receive, send)
