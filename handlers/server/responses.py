"""Responses every protocol's routes share."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

GONE = 499  # a client that went away; never seen by it (nginx's "client closed request")


def json_response(content: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status, media_type="application/json")
