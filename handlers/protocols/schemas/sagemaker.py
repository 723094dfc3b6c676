"""SageMaker's answers: health and the runtime API's `ModelError`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class Health(BaseModel):
    status: Literal["Healthy", "Unhealthy"]


class ModelError(BaseModel):
    """Any container error, as SageMaker reports it (HTTP 424, `x-amzn-errortype: ModelError`):
    the container's status and body ride in `OriginalStatusCode` and `OriginalMessage`."""

    ErrorCode: str  # noqa: N815 - SageMaker's key
    Message: str  # noqa: N815
    OriginalStatusCode: int  # noqa: N815
    OriginalMessage: str  # noqa: N815
