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


class SessionRequest(BaseModel):
    """A stateful session's management body on /invocations (DJL LMI's): open one, with the
    session header `NEW_SESSION`, or close the one the header names."""

    requestType: Literal["NEW_SESSION", "CLOSE"]  # noqa: N815 - DJL's key


class SessionAnswer(BaseModel):
    """DJL LMI's answer to a session request; the id rides in SageMaker's headers."""

    result: str


class LoadedModel(BaseModel):
    """A model loaded at runtime, as SageMaker's multi-model Get Model API describes it, with
    its health."""

    modelName: str  # noqa: N815 - SageMaker's key
    modelUrl: str  # noqa: N815
    ready: bool


class LoadedModelList(BaseModel):
    models: list[LoadedModel]
    nextPageToken: str | None = None  # noqa: N815
