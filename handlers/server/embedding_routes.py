"""Embeddings over HTTP: OpenAI's `POST /v1/embeddings`, `/invocations` bodies with `input`, and
Databricks' `POST /serving-endpoints/{model}/invocations` (chat, completions or embeddings by body,
as the endpoint's model does them).

The embedding model loads next to the LLM; until it is attached its routes answer 503.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from handlers.engine.embeddings import EmbeddingEngine
from handlers.engine.types import RequestValidationError
from handlers.protocols.databricks import check_endpoint_task, task_key
from handlers.protocols.openai import OpenAIError, model_not_found
from handlers.protocols.openai.embeddings import parse_embedding_request, render_embeddings
from handlers.server.body import BodyError, read_json, request_id
from handlers.server.openai_routes import OpenAIRoutes, error_response
from handlers.server.responses import json_response

log = logging.getLogger(__name__)


class EmbeddingSlot:
    """Where the embedding engine goes once loaded; callbacks learn its name then."""

    def __init__(self) -> None:
        self.engine: EmbeddingEngine | None = None
        self._on_attach: list[Callable[[EmbeddingEngine], None]] = []

    def attach(self, engine: EmbeddingEngine) -> None:
        self.engine = engine
        for callback in self._on_attach:
            callback(engine)

    def on_attach(self, callback: Callable[[EmbeddingEngine], None]) -> None:
        self._on_attach.append(callback)


def add_embedding_routes(app: FastAPI, slot: EmbeddingSlot | None, openai: OpenAIRoutes,
                         max_request_size: int) -> None:
    routes = EmbeddingRoutes(slot, openai, max_request_size)
    app.add_api_route("/v1/embeddings", routes.embeddings, methods=["POST"])
    app.add_api_route("/serving-endpoints/{model}/invocations", routes.databricks,
                      methods=["POST"])
    openai.body_routes["input"] = routes.embeddings_body
    if slot is not None:
        slot.on_attach(lambda engine: _list_model(openai.models, engine.model_name))


def _list_model(models: list[str], name: str) -> None:
    if name not in models:  # an embeddings-only server already lists it
        models.append(name)


class EmbeddingRoutes:
    def __init__(self, slot: EmbeddingSlot | None, openai: OpenAIRoutes,
                 max_request_size: int) -> None:
        self.slot = slot
        self.openai = openai
        self.max_request_size = max_request_size

    async def embeddings(self, request: Request) -> Response:
        rid = request_id(request)
        body = await self._read(request, rid)
        if isinstance(body, Response):
            return body
        return await self.embeddings_body(request, body, rid)

    async def databricks(self, model: str, request: Request) -> Response:
        """A served model's endpoint; the body says the task, as on Databricks."""
        rid = request_id(request)
        if model not in self.openai.models:
            return error_response(model_not_found(model, ", ".join(self.openai.models)))
        body = await self._read(request, rid)
        if isinstance(body, Response):
            return body
        try:
            key = task_key(body)
            check_endpoint_task(model, key, self._embedding_model())
        except OpenAIError as exc:
            log.info("[RequestId=%s] Databricks request refused: %s", rid, exc.message)
            return error_response(exc)
        return await self.openai.body_routes[key](request, body, rid)

    def _embedding_model(self) -> str | None:
        if self.openai.settings.embeddings_only:
            return self.openai.settings.model_name
        engine = self.slot.engine if self.slot is not None else None
        return engine.model_name if engine is not None else None

    async def embeddings_body(self, request: Request, body: Any, rid: str) -> Response:
        engine = self.slot.engine if self.slot is not None else None
        if engine is None:
            status = 503 if self.slot is not None else 404
            message = ("the embedding model is still loading" if status == 503
                       else "this server serves no embedding model (option.embedding_model_id)")
            return error_response(OpenAIError(message, "model", status))
        try:
            parsed = parse_embedding_request(body, engine.dimension)
            if parsed.model is not None and parsed.model != engine.model_name:
                raise model_not_found(parsed.model, engine.model_name)
            result = await engine.embed(parsed.texts, parsed.instruction, truncate=True)
        except OpenAIError as exc:
            log.info("[RequestId=%s] embeddings refused: %s", rid, exc.message)
            return error_response(exc)
        except RequestValidationError as exc:
            return error_response(OpenAIError(exc.message, exc.field))
        answer = render_embeddings(result.vectors, result.prompt_tokens, engine.model_name,
                                   parsed.encoding_format)
        return json_response(answer)

    async def _read(self, request: Request, rid: str) -> Any:
        try:
            return await read_json(request, self.max_request_size, 400)
        except BodyError as exc:
            log.info("[RequestId=%s] bad body: %s", rid, exc.message)
            return error_response(OpenAIError(exc.message, status=exc.status))
