"""Reading the request out of a DJL `Input` batch item."""

from __future__ import annotations

from typing import Any

import orjson

from handlers.protocols.lmi.errors import LmiError

# Where DJL Serving puts an adapter named outside the body: SageMaker's header as a property,
# `adapter=` of the custom attributes as a property, the `adapter` query parameter as content.
ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"
ADAPTER_KEY = "adapter"


def request_body(item: Any) -> Any:
    """The item's decoded JSON body; malformed JSON is an LmiError (424)."""
    try:
        return orjson.loads(item.get_as_bytes() or b"")
    except orjson.JSONDecodeError as exc:
        raise LmiError(f"request body is not valid JSON: {exc}") from None


def requested_adapter(item: Any) -> str | None:
    """The LoRA adapter the item names outside its body, first found in DJL LMI's order (the
    header, the custom attribute, the query parameter), or None."""
    properties = item.get_properties()
    for key in (ADAPTER_HEADER, ADAPTER_KEY):
        if properties.get(key) is not None:
            return properties[key]
    return item.get_as_string(ADAPTER_KEY) if item.contains_key(ADAPTER_KEY) else None
