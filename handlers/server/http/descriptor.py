"""What the app gathers of each protocol (`Protocol`, one per router module's `PROTOCOL`): its
routes, its documented operations and the bodies it answers on `/invocations`. Adding a
protocol is its module and its line in app.py; nothing else lists it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter
from starlette.datastructures import Headers
from starlette.requests import Request

from handlers.server.context import ServerContext
from handlers.server.framing import Answer

JSON = "application/json"
SSE = "text/event-stream"
JSONLINES = "application/jsonlines"
BINARY = "application/octet-stream"
TEXT = "text/plain"
STRING = str  # a body documented as text or bytes only
# A server-sent event (`data: {...}`): its data is one JSON event of the protocol's stream.
SSE_EVENT = {"type": "object", "properties": {
    "data": {"type": "string", "contentMediaType": JSON}, "event": {"type": "string"}}}
EMPTY = None  # a response without a body

# SageMaker's adapter header: it names the LoRA adapter whatever protocol the body speaks.
ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"
# SageMaker's free-form attributes; DJL Serving reads `key=value` pairs from them (`adapter`).
CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"

Operation = tuple[str, str]  # (method, path as FastAPI renders it)
BodyHandler = Callable[[ServerContext, Request, Any], Awaitable[Answer]]


@dataclass(frozen=True)
class Doc:
    """One operation: its request body (a type; None: it reads none), its 200 by media type,
    and its error statuses with their body."""

    summary: str
    request: Any = None
    ok: dict[str, Any] | None = None  # None: it never answers 200
    errors: dict[int, Any] = field(default_factory=dict)
    request_media: tuple[str, ...] = (JSON,)
    # the parameters it reads that FastAPI does not see (headers, query, path: OpenAPI objects)
    parameters: tuple[dict[str, Any], ...] = ()


def error_bodies(body: Any, *statuses: int) -> dict[int, Any]:
    """`body` as the answer of each of `statuses`."""
    return dict.fromkeys(statuses, body)


@dataclass(frozen=True)
class Body:
    """A body `/invocations` hands to this protocol: the first of all protocols' bodies, by
    `order`, whose `speaks` holds for a JSON object takes it; the one whose `speaks` is None
    takes what no other does (anything that is not an object too)."""

    order: int
    speaks: Callable[[ServerContext, dict[str, Any], Headers], bool] | None
    handler: BodyHandler
    doc: Doc  # what it reads and answers, as on the protocol's own route
    selector: str = "model"  # the field that names a LoRA adapter (ADAPTER_HEADER sets it)


@dataclass(frozen=True)
class Protocol:
    router: Callable[[ServerContext], APIRouter] | None = None
    docs: Mapping[Operation, Doc] = field(default_factory=dict)
    bodies: tuple[Body, ...] = ()


def merged(summary: str, docs: list[Doc]) -> Doc:
    """One operation that reads what any of `docs` reads and answers what any answers."""
    ok: dict[str, list[Any]] = {}
    failed: dict[int, list[Any]] = {}
    for doc in docs:
        for media, kind in (doc.ok or {}).items():
            ok.setdefault(media, []).append(kind)
        for status, kind in doc.errors.items():
            failed.setdefault(status, []).append(kind)
    return Doc(summary, _union([doc.request for doc in docs]),
               {media: _union(kinds) for media, kinds in ok.items()},
               {status: _union(kinds) for status, kinds in sorted(failed.items())})


def _union(kinds: list[Any]) -> Any:
    distinct = [kind for i, kind in enumerate(kinds) if kind not in kinds[:i]]
    if len(distinct) > 1 and any(isinstance(kind, dict) for kind in distinct):
        raise ValueError("a JSON schema cannot be joined with other kinds")
    union = distinct[0]
    for kind in distinct[1:]:
        union = union | kind
    return union
