"""Decoded request bodies into pydantic models, with errors that name the field: what every
protocol with a JSON body does first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from handlers.protocols.errors import ProtocolError

M = TypeVar("M", bound=BaseModel)


MAX_ERRORS = 10  # a list of a thousand bad items gets a message, not a megabyte
MAX_SHOWN = 100  # characters of a bad value repeated in the message


def describe_errors(exc: ValidationError) -> str:
    """One line per pydantic error: `parameters.top_p: Input should be ... (got 1.5)`."""
    parts = []
    for err in exc.errors(include_url=False)[:MAX_ERRORS]:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        got = err.get("input")
        shown = f" (got {_shown(got)})" if err["type"] != "missing" and _is_scalar(got) else ""
        parts.append(f"{where}: {err['msg']}{shown}")
    if (more := exc.error_count() - MAX_ERRORS) > 0:
        parts.append(f"and {more} more errors")
    return "; ".join(parts)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def parse_body(model: type[M], body: Any, refuse: Callable[[str], ProtocolError],
               not_an_object: str) -> M:
    """`body` as `model`; `refuse(message)` when it is not a JSON object or does not validate."""
    if not isinstance(body, dict):
        raise refuse(not_an_object)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise refuse(describe_errors(exc)) from None
