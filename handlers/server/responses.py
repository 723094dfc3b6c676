"""Responses every protocol's routes share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from starlette.responses import Response

from handlers.protocols.lmi.formatters import JSON_MEDIA_TYPE

GONE = 499  # a client that went away; never seen by it (nginx's "client closed request")


def json_response(content: Any, status: int = 200,
                  headers: Mapping[str, str] | None = None) -> Response:
    return Response(orjson.dumps(content), status, headers, media_type=JSON_MEDIA_TYPE)
