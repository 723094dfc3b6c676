"""DJL Serving LMI protocol: the `inputs` / `parameters` / `stream` schema and its formatters."""

from handlers.protocols.lmi.accumulator import Accumulator
from handlers.protocols.lmi.errors import LmiError
from handlers.protocols.lmi.formatters import (
    RenderOptions,
    StreamRenderer,
    StreamStyle,
    early_failure,
    error_body,
    render_json,
    stream_style,
)
from handlers.protocols.lmi.request import LmiRequest, parse_lmi_request, to_generation_request

__all__ = [
    "Accumulator",
    "LmiError",
    "LmiRequest",
    "RenderOptions",
    "StreamRenderer",
    "StreamStyle",
    "early_failure",
    "error_body",
    "parse_lmi_request",
    "render_json",
    "stream_style",
    "to_generation_request",
]
