"""The OpenAPI document (`GET /openapi.json`, browsed at `/docs`), built once on first request.

The routes read and validate their bodies by hand (guard.py, body.py, the protocol modules), so
FastAPI sees no body schemas; this module adds them from each protocol's descriptor (`Doc`s):
each operation's request body is the model its protocol parses with (so the document cannot
drift from what is accepted), and its responses are the answer and the error shape of its
protocol (protocols/schemas). FastAPI's own rendering supplies the paths and their parameters.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, TypeAdapter

from handlers.server.http.descriptor import EMPTY, JSON, STRING, Doc, Operation

REF = "#/components/schemas/{model}"
OWN_STATUSES = {529: "Overloaded"}  # statuses of a protocol's own (Anthropic's), not HTTP's


class _Schemas:
    """JSON schemas of Python types, their models gathered under components/schemas."""

    def __init__(self) -> None:
        self.components: dict[str, Any] = {}

    def of(self, kind: Any) -> dict[str, Any]:
        if kind is STRING:
            return {"type": "string"}
        if isinstance(kind, dict):  # a JSON schema already
            return kind
        schema = TypeAdapter(kind).json_schema(ref_template=REF)
        for name, definition in schema.pop("$defs", {}).items():
            self._add(name, definition)
        if isinstance(kind, type) and issubclass(kind, BaseModel):  # a model: by reference
            self._add(kind.__name__, schema)
            return {"$ref": REF.format(model=kind.__name__)}
        return schema

    def _add(self, name: str, schema: dict[str, Any]) -> None:
        if self.components.setdefault(name, schema) != schema:
            raise ValueError(f"two different schemas are named {name}")


def _operation(operation: dict[str, Any], doc: Doc, schemas: _Schemas) -> None:
    operation["summary"] = doc.summary
    if doc.parameters:
        operation.setdefault("parameters", []).extend(doc.parameters)
    if doc.request is not None:
        schema = schemas.of(doc.request)
        content = {media: {"schema": schema if media == JSON else {"type": "string",
                                                                  "format": "binary"}}
                   for media in doc.request_media}
        operation["requestBody"] = {"required": True, "content": content}
    responses = {} if doc.ok is None else {"200": _response(200, doc.ok, schemas)}
    for status, body in sorted(doc.errors.items()):
        responses[str(status)] = _response(status, {JSON: body}, schemas)
    operation["responses"] = responses


def _response(status: int, bodies: dict[str, Any], schemas: _Schemas) -> dict[str, Any]:
    phrase = OWN_STATUSES.get(status) or HTTPStatus(status).phrase
    answer: dict[str, Any] = {"description": phrase}
    content = {media: {"schema": schemas.of(kind)} for media, kind in bodies.items()
               if kind is not EMPTY}
    if content:
        answer["content"] = content
    return answer


def document(app: FastAPI, version: str, docs: dict[Operation, Doc]) -> dict[str, Any]:
    """The app's OpenAPI document, every documented operation's bodies filled in."""
    spec = get_openapi(title=app.title, version=version, routes=app.routes,
                       description="An LLM served over LMI, SageMaker, OpenAI, Databricks, "
                                   "KServe V1/V2, Triton generate and TGI's protocols.")
    schemas = _Schemas()
    for path, operations in spec.get("paths", {}).items():
        for method, operation in operations.items():
            if (doc := docs.get((method, path))) is not None:
                _operation(operation, doc, schemas)
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422s, replaced
        components.pop(unused, None)
    components.update(schemas.components)
    return spec


def install(app: FastAPI, version: str, docs: dict[Operation, Doc]) -> None:
    """Serve the document at app.openapi_url, built on its first request."""
    built: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not built:
            built.update(document(app, version, docs))
        return built

    app.openapi = openapi  # type: ignore[method-assign]

