"""KServe V1 and V2 (and Triton generate) bodies: V1's request, which is parsed by hand, and
the answers."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from handlers.protocols.parameters import LmiParameters
from handlers.protocols.schemas.common import Open


class KServeErrorBody(BaseModel):
    """KServe V1, V2 and Triton's error: `{"error": "<message>"}`."""

    error: str


class V1Instance(LmiParameters):
    """One prompt, in exactly one of `text`, `prompt` or `inputs`, with LMI's generation
    fields at the top level or under `parameters` (beam search, n and best_of > 1 are
    refused)."""

    text: str | None = Field(None, min_length=1)
    prompt: str | None = Field(None, min_length=1)
    inputs: str | None = Field(None, min_length=1)
    parameters: LmiParameters | None = None


class V1Request(BaseModel):
    """A generation model takes prompt strings or instance objects; an embedding model takes
    strings."""

    instances: list[str | V1Instance] = Field(min_length=1)


class V1Predictions(BaseModel):
    """Each instance's generated text, or an embedding model's vector."""

    predictions: list[str | list[float]]


class ReadyAnswer(BaseModel):
    name: str
    ready: bool


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class OutputTensor(Open):
    name: str
    datatype: str
    shape: list[int]
    data: list[Any] | None = None
    parameters: dict[str, Any] | None = None


class InferResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[OutputTensor]


class Live(BaseModel):
    live: bool


class Ready(BaseModel):
    ready: bool


class GenerateAnswer(Open):
    """Triton / MindIE Service's generate; a streamed event has the same keys, with the text
    its token released."""

    id: str | None
    model_name: str
    model_version: str | None
    text_output: str
    details: dict[str, Any] | None = None
    prefill_time: float | None = None
    decode_time: float | None = None
