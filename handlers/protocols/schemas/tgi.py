"""TGI's answers and errors."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from handlers.protocols.schemas.common import Open


class TgiGenerated(Open):
    generated_text: str
    details: dict[str, Any] | None = None


class TgiErrorBody(BaseModel):
    error: str
    error_type: str


class TgiInfo(Open):
    model_id: str
    model_dtype: str | None
    model_device_type: str | None
    model_pipeline_tag: str
    max_concurrent_requests: int | None
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int | None
    max_total_tokens: int | None
    router: str
    version: str
