"""OpenAI's (and Databricks') embeddings request and response: pure parsing and rendering."""

from __future__ import annotations

import base64
import uuid
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from handlers.protocols.chat.errors import OpenAIError, validate_body


class EmbeddingRequest(BaseModel):
    # Unknown fields are ignored, as for chat and completions (vLLM's behaviour).
    model_config = ConfigDict(extra="ignore")

    input: str | list[str] = Field(...)
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    instruction: str | None = None  # Databricks: prepended to every input

    @field_validator("input", mode="before")
    @classmethod
    def _no_token_ids(cls, value: Any) -> Any:
        # OpenAI also takes token ids of its own tokenizer: meaningless to this model.
        if isinstance(value, list) and any(isinstance(v, int | list) for v in value):
            raise ValueError("token-id arrays are not supported, send text (LangChain's "
                             "OpenAIEmbeddings: set check_embedding_ctx_length=False)")
        return value

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


def parse_embedding_request(body: Any, dimension: int) -> EmbeddingRequest:
    """Validate the body; raise OpenAIError (400) naming the field."""
    request = validate_body(EmbeddingRequest, body)
    if not request.texts:
        raise OpenAIError("'input' must not be empty", "input", code="invalid_value")
    if request.dimensions is not None and request.dimensions != dimension:
        # Truncating a vector is only meaningful for Matryoshka-trained models; this one is not.
        raise OpenAIError(f"this model's embeddings have {dimension} dimensions; "
                          f"'dimensions' must be {dimension} or absent", "dimensions",
                          code="invalid_value")
    return request


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI's clients decode it
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


def render_embeddings(vectors: list[list[float]], prompt_tokens: int, model: str,
                      encoding_format: str) -> dict[str, Any]:
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, encoding_format)}
            for i, v in enumerate(vectors)]
    # `id`: Databricks' response has one; OpenAI's clients ignore it.
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
