"""DJL Serving's adapter management answers (handlers/protocols/adapter_management.py)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class DjlStatus(BaseModel):
    status: str  # e.g. "Adapter a1 registered"


class DjlAdapter(BaseModel):
    name: str
    src: str
    pin: bool


class DjlAdapterList(BaseModel):
    adapters: list[DjlAdapter]
    nextPageToken: str | None = Field(default=None)  # noqa: N815 (DJL's key)


class DjlErrorBody(BaseModel):
    code: int
    type: str
    message: str
