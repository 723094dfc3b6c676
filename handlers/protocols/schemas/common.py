"""Shapes shared by the schema modules."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Open(BaseModel):
    """An object that may carry more keys than it documents (protocols grow fields)."""

    model_config = ConfigDict(extra="allow")
