"""KServe's Open Inference Protocol (V2) for text generation, as Triton serves LLMs.

The model takes one `BYTES` input, `text_input` (shape `[n]` or `[n, 1]`: n prompts), and returns
one `BYTES` output, `text_output` (the n generated texts). Generation parameters ride in the
request's `parameters` (LMI's names: `max_new_tokens`, `temperature`, `top_p`, `seed`, `stop`,
...); Triton's own `timeout` (microseconds) bounds the request. BYTES data comes as JSON strings
or, in Triton's binary tensor data extension, as elements each prefixed by its 4-byte
little-endian length; the wire (REST body tail, gRPC raw contents) hands those bytes over.
Everything here is pure: requests in, plain objects out, `KServeError`s for what is refused.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from handlers.engine.types import GenerationRequest
from handlers.protocols.bodies import describe_errors, parse_body
from handlers.protocols.checks import naming
from handlers.protocols.errors import ErrorKind, KServeError
from handlers.protocols.parameters import LmiParameters, to_sampling_params

TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"
BYTES = "BYTES"
MODEL_VERSION = "1"
PLATFORM = "lmi-serve"
EXTENSIONS = ["binary_tensor_data", "parameters"]
_LENGTH = struct.Struct("<I")
# Parameters Triton's clients reserve for the server (not generation parameters).
_SEQUENCE = ("sequence_id", "sequence_start", "sequence_end")
_RESERVED = frozenset({*_SEQUENCE, "priority", "timeout", "binary_data_output", "headers"})


@dataclass(frozen=True)
class Tensor:
    """A tensor as a wire carries it, before its data is checked against its shape."""

    name: str
    datatype: str
    shape: list[int]
    data: list[Any] | None = None  # JSON data (nested or flat), or None when raw bytes carry it
    raw: bytes | None = None  # the binary data (REST's binary extension, gRPC's raw contents)
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class InferRequest:
    id: str
    prompts: list[str]
    parameters: dict[str, Any]
    outputs: dict[str, bool | None] | None  # requested output -> binary (None: not said)


def model_metadata(model: str) -> dict[str, Any]:
    tensor = {"datatype": BYTES, "shape": [-1]}
    return {"name": model, "versions": [MODEL_VERSION], "platform": PLATFORM,
            "inputs": [{"name": TEXT_INPUT, **tensor}],
            "outputs": [{"name": TEXT_OUTPUT, **tensor}]}


def check_model(model: str, version: str | None, served: str | None,
                adapters: Sequence[str] = ()) -> str | None:
    """The LoRA adapter `model` names (None: the generation model `served` itself): a model
    served as its base model's adapter is a model of its own here, as vLLM lists it. Refuse
    (404) any other model (`served` None: there is none) or a version it does not have."""
    if model != served and (served is None or model not in adapters):
        names = ", ".join([served, *adapters]) if served else "none"
        raise KServeError(f"model '{model}' is not served here (models: {names})",
                          ErrorKind.NOT_FOUND)
    check_version(model, version)
    return None if model == served else model


def check_version(model: str, version: str | None) -> None:
    if version is not None and version != MODEL_VERSION:
        raise KServeError(f"model '{model}' has no version '{version}' (versions: "
                          f"{MODEL_VERSION})", ErrorKind.NOT_FOUND)


# --- requests -----------------------------------------------------------------------------------


class RestInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    shape: list[int] = Field(min_length=1)
    datatype: str
    parameters: dict[str, Any] = Field(default_factory=dict)
    data: list[Any] | None = None


class RestOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    parameters: dict[str, Any] = Field(default_factory=dict)


class RestInferRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)
    inputs: list[RestInput] = Field(min_length=1)
    outputs: list[RestOutput] | None = None


def parse_rest_request(body: Any, binary: bytes) -> InferRequest:
    """An `/infer` body (`binary`: what follows the JSON header under the binary extension)."""
    request = parse_body(RestInferRequest, body, KServeError,
                         "the request body must be a JSON object with 'inputs'")
    tensors, offset = [], 0
    for given in request.inputs:
        raw = None
        if "binary_data_size" in given.parameters:
            size = given.parameters["binary_data_size"]
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise KServeError(f"input '{given.name}': binary_data_size {size!r} does not fit "
                                  f"the {len(binary)} bytes of binary data in the request")
            raw, offset = binary[offset:offset + size], offset + size
        tensors.append(Tensor(given.name, given.datatype, given.shape, given.data, raw,
                              given.parameters))
    if offset != len(binary):
        raise KServeError(f"the request carries {len(binary) - offset} bytes of binary data "
                          "that no input claims")
    outputs = None if request.outputs is None else {
        o.name: o.parameters.get("binary_data") for o in request.outputs}
    return infer_request(request.id, tensors, request.parameters, outputs)


def infer_request(request_id: str, tensors: list[Tensor], parameters: dict[str, Any],
                  outputs: dict[str, bool | None] | None) -> InferRequest:
    """Check the tensors and requested outputs; the prompts they carry."""
    names = [tensor.name for tensor in tensors]
    if names != [TEXT_INPUT]:
        unknown = [name for name in names if name != TEXT_INPUT]
        what = f"unknown input '{unknown[0]}'" if unknown else "'text_input' given twice"
        raise KServeError(f"{what}: this model takes one input, '{TEXT_INPUT}' ({BYTES})")
    for name in outputs or {}:
        if name != TEXT_OUTPUT:
            raise KServeError(f"unknown output '{name}': this model returns '{TEXT_OUTPUT}'")
    for key in _SEQUENCE:
        if key in parameters:
            raise KServeError(f"parameters.{key}: sequence batching is not supported")
    return InferRequest(request_id, _prompts(tensors[0]), parameters, outputs)


def _prompts(tensor: Tensor) -> list[str]:
    where = f"input '{tensor.name}'"
    if tensor.datatype != BYTES:
        raise KServeError(f"{where} has datatype {tensor.datatype}; expected {BYTES}")
    if any(dim < 0 for dim in tensor.shape) or len(tensor.shape) > 2 or (
            len(tensor.shape) == 2 and tensor.shape[1] != 1):
        raise KServeError(f"{where} has shape {tensor.shape}; expected [n] or [n, 1]")
    count = math.prod(tensor.shape)
    if tensor.raw is not None:
        elements = [_text(item, where) for item in decode_bytes(tensor.raw, where)]
    elif tensor.data is not None:
        elements = [_text(item, where) for item in _flatten(tensor.data)]
    else:
        raise KServeError(f"{where} has no data")
    if len(elements) != count:
        raise KServeError(f"{where} has shape {tensor.shape} ({count} elements) but "
                          f"{len(elements)} data elements")
    if not elements:
        raise KServeError(f"{where} holds no prompt")
    return elements


def _flatten(data: list[Any]) -> list[Any]:
    flat: list[Any] = []
    for item in data:
        flat.extend(_flatten(item) if isinstance(item, list) else [item])
    return flat


def _text(item: Any, where: str) -> str:
    if isinstance(item, bytes):
        try:
            item = item.decode("utf-8")
        except UnicodeDecodeError:
            raise KServeError(f"{where}: an element is not UTF-8 text") from None
    if not isinstance(item, str) or not item:
        raise KServeError(f"{where}: every element must be a non-empty string (got {item!r})")
    return item


def decode_bytes(raw: bytes, where: str) -> list[bytes]:
    """BYTES elements from Triton's binary form: each a 4-byte little-endian length, then it."""
    items, offset = [], 0
    while offset < len(raw):
        if offset + _LENGTH.size > len(raw):
            raise KServeError(f"{where}: binary BYTES data ends inside an element's length")
        (size,) = _LENGTH.unpack_from(raw, offset)
        offset += _LENGTH.size
        if offset + size > len(raw):
            raise KServeError(f"{where}: binary BYTES data ends inside an element")
        items.append(raw[offset:offset + size])
        offset += size
    return items


def encode_bytes(items: list[str]) -> bytes:
    return b"".join(_LENGTH.pack(len(data)) + data for data in (i.encode() for i in items))


def generation_requests(request: InferRequest, adapter: str | None = None
                        ) -> tuple[list[GenerationRequest], LmiParameters]:
    """One engine request per prompt, with the request's generation parameters (and the LoRA
    adapter its model names)."""
    given = {k: v for k, v in request.parameters.items() if k not in _RESERVED}
    try:
        params = LmiParameters.model_validate(given)
    except ValidationError as exc:
        raise KServeError("parameters." + describe_errors(exc)) from None
    if params.num_beams > 1 or params.num_sequences > 1:
        raise KServeError("parameters: beam search, n and best_of > 1 are not supported here")
    sampling = to_sampling_params(params)
    return [GenerationRequest(prompt, sampling, adapter=adapter)
            for prompt in request.prompts], params


def timeout_seconds(request: InferRequest) -> float | None:
    """Triton's `timeout` parameter (microseconds), in seconds."""
    value = request.parameters.get("timeout")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise KServeError(f"parameters.timeout: expected microseconds > 0 (got {value!r})")
    return value / 1e6


# --- responses ----------------------------------------------------------------------------------


def render_response(model: str, request: InferRequest, texts: list[str]
                    ) -> tuple[dict[str, Any], bytes]:
    """The response object and, under the binary extension, the output bytes after it."""
    wanted = request.outputs if request.outputs is not None else {TEXT_OUTPUT: None}
    binary = wanted.get(TEXT_OUTPUT)
    if binary is None:  # the output did not say: the request's default
        binary = bool(request.parameters.get("binary_data_output"))
    output: dict[str, Any] = {"name": TEXT_OUTPUT, "datatype": BYTES, "shape": [len(texts)]}
    tail = b""
    if binary:
        tail = encode_bytes(texts)
        output["parameters"] = {"binary_data_size": len(tail)}
    else:
        output["data"] = texts
    answer: dict[str, Any] = {"model_name": model, "model_version": MODEL_VERSION}
    if request.id:
        answer["id"] = request.id
    answer["outputs"] = [output] if TEXT_OUTPUT in wanted else []
    return answer, tail


# The engine's refusals name the prompt by its place in the text_input tensor.
CHECKS = naming(KServeError, lambda i: f"{TEXT_INPUT}[{i}]")
