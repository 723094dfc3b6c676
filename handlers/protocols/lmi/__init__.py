"""DJL Serving LMI protocol: the `inputs` / `parameters` / `stream` schema and its formatters
(rolling batch), the dynamic-batch schema (`dynamic`), and their streams as the driver's
renderers (`events`)."""

from handlers.protocols.lmi.errors import LmiError, LmiFailure, generation_error
from handlers.protocols.lmi.events import LineEvents, TokenEvents
from handlers.protocols.lmi.formatters import (
    RenderOptions,
    StreamRenderer,
    StreamStyle,
    answer_style,
    early_failure,
    render_json,
    stream_style,
)
from handlers.protocols.lmi.request import (
    CHECKS,
    LmiRequest,
    lmi_adapters,
    parse_lmi_request,
    to_generation_request,
)

__all__ = [
    "CHECKS",
    "LineEvents",
    "LmiError",
    "LmiFailure",
    "LmiRequest",
    "RenderOptions",
    "StreamRenderer",
    "StreamStyle",
    "TokenEvents",
    "answer_style",
    "early_failure",
    "generation_error",
    "lmi_adapters",
    "parse_lmi_request",
    "render_json",
    "stream_style",
    "to_generation_request",
]
