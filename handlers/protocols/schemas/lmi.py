"""DJL LMI's answers (its input/output schema): rolling batch, dynamic batch, and their errors."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from handlers.protocols.schemas.common import Open


class LmiToken(Open):
    id: int
    text: str
    log_prob: float | None = None
    special_token: bool | None = Field(None, description="present, true, on special tokens")


class LmiDetails(Open):
    finish_reason: str | None = Field(description="length, eos_token, stop_sequence or error")
    generated_tokens: int | None
    inputs: str | None = None
    tokens: list[LmiToken] | None = None
    prefill: list[LmiToken] | None = None
    top_tokens: list[list[dict[str, Any]]] | None = None
    best_of_sequences: list[dict[str, Any]] | None = None


class LmiAnswer(Open):
    """A rolling-batch answer; `details` with `parameters.details`. Under
    `option.tgi_compat` the answer is a list of one, with TGI's token keys."""

    generated_text: str
    details: LmiDetails | dict[str, Any] | None = None


class DynamicAnswer(Open):
    """One input's answer under dynamic batching (`option.rolling_batch=disable`)."""

    generated_text: str


class LmiErrorBody(Open):
    """A refusal `{"error", "code"}`; a failed generation also carries DJL LMI's
    `generated_text: ""` and `details.finish_reason: error`; a dynamic-batch failure DJL's
    `message: "invoke handler failure"`."""

    error: str
    code: int
