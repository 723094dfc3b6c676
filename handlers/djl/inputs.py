"""Reading the request out of a DJL `Input` batch item."""

from __future__ import annotations

from typing import Any

import orjson

from handlers.protocols.lmi.errors import LmiError


def request_body(item: Any) -> Any:
    """The item's decoded JSON body; malformed JSON is an LmiError (424)."""
    try:
        return orjson.loads(item.get_as_bytes() or b"")
    except orjson.JSONDecodeError as exc:
        raise LmiError(f"request body is not valid JSON: {exc}") from None
