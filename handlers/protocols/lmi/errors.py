"""LMI's error shape: `{"error": "<what is wrong>", "code": <status>}` (seed 004)."""

from __future__ import annotations

import orjson

# DJL answers failed validation and failed inference with 424 (Failed Dependency).
VALIDATION_STATUS = 424


class LmiError(Exception):
    """A request the LMI protocol refuses; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = VALIDATION_STATUS) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    def body(self) -> bytes:
        return orjson.dumps({"error": self.message, "code": self.status})
