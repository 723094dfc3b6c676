"""The OpenAPI document (`GET /openapi.json`, browsed at `/docs`), built once on first request.

The routes read and validate their bodies by hand (guard.py, body.py, the protocol modules), so
FastAPI sees no body schemas; this module adds them: each operation's request body is the model
its protocol parses with (so the document cannot drift from what is accepted), and its
responses are the answer and the error shape of its protocol (protocols/schemas). FastAPI's
own rendering supplies the paths and their parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, TypeAdapter

from handlers.protocols.anthropic.requests import CountTokensRequest, MessagesRequest
from handlers.protocols.chat.requests import ChatCompletionRequest
from handlers.protocols.generate import GenerateRequest
from handlers.protocols.kserve_v2 import RestInferRequest
from handlers.protocols.lmi.dynamic import DynamicRequest
from handlers.protocols.lmi.request import LmiRequest
from handlers.protocols.openai.embeddings import EmbeddingRequest
from handlers.protocols.openai.requests import CompletionRequest
from handlers.protocols.openai_responses import ResponsesRequest
from handlers.protocols.schemas.anthropic import (
    AnthropicErrorBody,
    AnthropicMessage,
    InputTokens,
)
from handlers.protocols.schemas.kserve import (
    GenerateAnswer,
    InferResponse,
    KServeErrorBody,
    Live,
    ModelMetadata,
    Ready,
    ReadyAnswer,
    ServerMetadata,
    V1Predictions,
    V1Request,
)
from handlers.protocols.schemas.lmi import DynamicAnswer, LmiAnswer, LmiErrorBody
from handlers.protocols.schemas.openai import (
    ChatCompletion,
    Completion,
    EmbeddingList,
    ModelList,
    OpenAIErrorBody,
    ResponseDeleted,
    ResponseObject,
)
from handlers.protocols.schemas.sagemaker import Health, ModelError
from handlers.protocols.schemas.tgi import TgiErrorBody, TgiGenerated, TgiInfo
from handlers.protocols.schemas.tokens import DetokenizeAnswer, TokenizeAnswer
from handlers.protocols.tgi import TgiRequest
from handlers.protocols.tokens import DetokenizeRequest, TokenizeChatRequest, TokenizePromptRequest

JSON = "application/json"
SSE = "text/event-stream"
JSONLINES = "application/jsonlines"
BINARY = "application/octet-stream"
EVENT_STREAM = "application/vnd.amazon.eventstream"
TEXT = "text/plain"
STRING = str  # a body documented as text or bytes only
# A server-sent event (`data: {...}`): its data is one JSON event of the protocol's stream.
SSE_EVENT = {"type": "object", "properties": {
    "data": {"type": "string", "contentMediaType": JSON}, "event": {"type": "string"}}}
EMPTY = None  # a response without a body
REF = "#/components/schemas/{model}"
OWN_STATUSES = {529: "Overloaded"}  # statuses of a protocol's own (Anthropic's), not HTTP's


@dataclass(frozen=True)
class Doc:
    """One operation: its request body (a type; None: it reads none), its 200 by media type,
    and its error statuses with their body."""

    summary: str
    request: Any = None
    ok: dict[str, Any] | None = None  # None: it never answers 200
    errors: dict[int, Any] = field(default_factory=dict)
    request_media: tuple[str, ...] = (JSON,)
    headers: tuple[dict[str, Any], ...] = ()  # header parameters it reads


BINARY_LENGTH = {"name": "Inference-Header-Content-Length", "in": "header", "required": False,
                 "description": "Triton's binary tensor data extension: the length of the JSON "
                                "header; binary tensor data follows it",
                 "schema": {"type": "string", "pattern": "^[0-9]+$"}}


def _errors(body: Any, *statuses: int) -> dict[int, Any]:
    return dict.fromkeys(statuses, body)


# What /invocations (and the routes that answer as it does) accepts, in the order it is tried.
INVOCATION = MessagesRequest | ChatCompletionRequest | CompletionRequest | EmbeddingRequest \
    | LmiRequest | DynamicRequest
INVOCATION_ANSWER = AnthropicMessage | ChatCompletion | Completion | EmbeddingList | LmiAnswer \
    | list[LmiAnswer] | list[DynamicAnswer]
INVOCATION_ERRORS = {
    **_errors(LmiErrorBody | OpenAIErrorBody | AnthropicErrorBody, 404, 408, 413, 424, 500, 503),
    **_errors(AnthropicErrorBody, 504, 529), 400: OpenAIErrorBody | AnthropicErrorBody}
INVOCATION_STREAMS = {JSONLINES: STRING, SSE: SSE_EVENT}
OPENAI_ERRORS = _errors(OpenAIErrorBody, 400, 404, 408, 413, 500, 503)
KSERVE_ERRORS = _errors(KServeErrorBody, 400, 404, 408, 413, 500, 503)
ANTHROPIC_ERRORS = _errors(AnthropicErrorBody, 400, 404, 413, 500, 503, 504, 529)
TOKENS_ERRORS = _errors(OpenAIErrorBody, 400, 404, 413, 500, 503)
TGI_ERRORS = _errors(TgiErrorBody, 404, 408, 413, 422, 424, 429, 500, 503)


def _invocations(summary: str) -> Doc:
    return Doc(summary, INVOCATION, {JSON: INVOCATION_ANSWER, **INVOCATION_STREAMS},
               INVOCATION_ERRORS)


def _generate(stream: bool) -> Doc:
    ok = {SSE: SSE_EVENT} if stream else {JSON: GenerateAnswer}
    return Doc("Triton / MindIE generate" + (" (one event per token)" if stream else ""),
               GenerateRequest, ok, KSERVE_ERRORS)


def _v2(versioned: str) -> dict[tuple[str, str], Doc]:
    """The V2 model routes under `/v2/models/{model}` + `versioned`."""
    docs = {
        ("get", ""): Doc("KServe V2 model metadata", ok={JSON: ModelMetadata},
                         errors=_errors(KServeErrorBody, 404)),
        ("get", "/ready"): Doc("KServe V2 model readiness", ok={JSON: ReadyAnswer},
                               errors={404: KServeErrorBody, 503: ReadyAnswer}),
        ("post", "/infer"): Doc(
            "KServe V2 inference (JSON, or Triton's binary tensor data extension with "
            "Inference-Header-Content-Length)", RestInferRequest,
            {JSON: InferResponse, BINARY: STRING}, KSERVE_ERRORS, (JSON, BINARY),
            (BINARY_LENGTH,)),
        ("post", "/generate"): _generate(stream=False),
        ("post", "/generate_stream"): _generate(stream=True),
    }
    return {(method, f"/v2/models/{{model}}{versioned}{tail}"): doc
            for (method, tail), doc in docs.items()}


def _tgi(summary: str, ok: dict[str, Any]) -> Doc:
    return Doc(summary, TgiRequest, ok, TGI_ERRORS)


DOCS: dict[tuple[str, str], Doc] = {
    ("get", "/ping"): Doc("SageMaker health: 200 once every served model can answer",
                          errors={503: Health}, ok={JSON: Health}),
    ("post", "/invocations"): _invocations(
        "SageMaker / DJL LMI: Anthropic Messages (`messages` with an `anthropic-version` "
        "header, `anthropic_version`, `system` or tool_use/tool_result blocks), OpenAI chat "
        "(`messages`), completion (`prompt`), embeddings (`input`), else LMI's schema "
        "(`inputs`, `parameters`, `stream`)"),
    ("post", "/predictions/{model}"): _invocations("DJL's predictions: as /invocations"),
    ("post", "/endpoints/{name}/invocations"): Doc(
        "SageMaker runtime InvokeEndpoint, emulated", INVOCATION,
        {JSON: INVOCATION_ANSWER, **INVOCATION_STREAMS}, {424: ModelError}),
    ("post", "/endpoints/{name}/invocations-response-stream"): Doc(
        "SageMaker runtime InvokeEndpointWithResponseStream, emulated (AWS event-stream "
        "PayloadParts)", INVOCATION, {EVENT_STREAM: STRING}, {424: ModelError}),
    ("get", "/v1/models"): Doc("OpenAI's and KServe V1's model list", ok={JSON: ModelList}),
    ("post", "/v1/chat/completions"): Doc("OpenAI chat completions", ChatCompletionRequest,
                                          {JSON: ChatCompletion, SSE: SSE_EVENT}, OPENAI_ERRORS),
    ("post", "/v1/completions"): Doc("OpenAI completions", CompletionRequest,
                                     {JSON: Completion, SSE: SSE_EVENT}, OPENAI_ERRORS),
    ("post", "/v1/responses"): Doc("OpenAI Responses API", ResponsesRequest,
                                   {JSON: ResponseObject, SSE: SSE_EVENT}, OPENAI_ERRORS),
    ("get", "/v1/responses/{response_id}"): Doc("A stored response", ok={JSON: ResponseObject},
                                                errors=_errors(OpenAIErrorBody, 400, 404)),
    ("delete", "/v1/responses/{response_id}"): Doc("Delete a stored response",
                                                   ok={JSON: ResponseDeleted},
                                                   errors=_errors(OpenAIErrorBody, 404)),
    ("post", "/v1/messages"): Doc("Anthropic Messages", MessagesRequest,
                                  {JSON: AnthropicMessage, SSE: SSE_EVENT}, ANTHROPIC_ERRORS),
    ("post", "/v1/messages/count_tokens"): Doc(
        "Anthropic Messages: the prompt's tokens", CountTokensRequest, {JSON: InputTokens},
        _errors(AnthropicErrorBody, 400, 404, 413, 500, 503)),
    ("post", "/tokenize"): Doc("vLLM's tokenize: a prompt, or chat messages as chat renders them",
                               TokenizePromptRequest | TokenizeChatRequest,
                               {JSON: TokenizeAnswer}, TOKENS_ERRORS),
    ("post", "/detokenize"): Doc("vLLM's detokenize", DetokenizeRequest,
                                 {JSON: DetokenizeAnswer}, TOKENS_ERRORS),
    ("post", "/v1/embeddings"): Doc("OpenAI embeddings", EmbeddingRequest,
                                    {JSON: EmbeddingList},
                                    _errors(OpenAIErrorBody, 400, 404, 413, 500, 503)),
    ("post", "/serving-endpoints/{model}/invocations"): Doc(
        "Databricks serving endpoint: chat, completions or embeddings by body",
        ChatCompletionRequest | CompletionRequest | EmbeddingRequest,
        {JSON: ChatCompletion | Completion | EmbeddingList, SSE: SSE_EVENT}, OPENAI_ERRORS),
    ("get", "/v1/models/{model}"): Doc("KServe V1 model readiness", ok={JSON: ReadyAnswer},
                                       errors={404: KServeErrorBody, 503: ReadyAnswer}),
    ("post", "/v1/models/{model}:predict"): Doc("KServe V1 predict", V1Request,
                                                {JSON: V1Predictions}, KSERVE_ERRORS),
    ("post", "/v1/models/{model}:explain"): Doc(
        "KServe V1 explain: not supported (501)", errors=_errors(KServeErrorBody, 404, 501)),
    ("get", "/v2"): Doc("KServe V2 server metadata", ok={JSON: ServerMetadata}),
    ("get", "/v2/health/live"): Doc("KServe V2 liveness", ok={JSON: Live}),
    ("get", "/v2/health/ready"): Doc("KServe V2 readiness", ok={JSON: Ready},
                                     errors={503: Ready}),
    **_v2(""),
    **_v2("/versions/{version}"),
    ("post", "/generate"): _tgi("TGI generate", {JSON: TgiGenerated}),
    ("post", "/generate_stream"): _tgi("TGI generate_stream (failures are events too)",
                                       {SSE: SSE_EVENT}),
    ("post", "/"): _tgi("TGI's compat route: `stream` chooses",
                        {JSON: list[TgiGenerated], SSE: SSE_EVENT}),
    ("get", "/info"): Doc("TGI server info", ok={JSON: TgiInfo}),
    ("get", "/health"): Doc("TGI health", ok={JSON: EMPTY}, errors={503: TgiErrorBody}),
    ("get", "/"): Doc("TGI health", ok={JSON: EMPTY}, errors={503: TgiErrorBody}),
    ("get", "/metrics"): Doc("Prometheus metrics", ok={TEXT: STRING}),
}


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
    if doc.headers:
        operation.setdefault("parameters", []).extend(doc.headers)
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


def document(app: FastAPI, version: str) -> dict[str, Any]:
    """The app's OpenAPI document, every documented operation's bodies filled in."""
    spec = get_openapi(title=app.title, version=version, routes=app.routes,
                       description="An LLM served over LMI, SageMaker, OpenAI, Databricks, "
                                   "KServe V1/V2, Triton generate and TGI's protocols.")
    schemas = _Schemas()
    for path, operations in spec.get("paths", {}).items():
        for method, operation in operations.items():
            if (doc := DOCS.get((method, path))) is not None:
                _operation(operation, doc, schemas)
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422s, replaced
        components.pop(unused, None)
    components.update(schemas.components)
    return spec


def install(app: FastAPI, version: str) -> None:
    """Serve the document at app.openapi_url, built on its first request."""
    built: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not built:
            built.update(document(app, version))
        return built

    app.openapi = openapi  # type: ignore[method-assign]

