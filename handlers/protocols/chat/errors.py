"""OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`, which every
OpenAI-compatible protocol here answers with (chat and completions, the Responses API,
Databricks' endpoints, vLLM's tokenizer endpoints) and the chat machinery raises (Anthropic turns
it into its own).

`param` names the offending field as OpenAI spells it (`messages[1].role`, `top_p`); `code` is
OpenAI's string code where it has one (`model_not_found`, `context_length_exceeded`,
`invalid_value`...), else null.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from handlers.protocols.adapters import UnknownAdapter, adapter_named
from handlers.protocols.errors import REFUSALS, ErrorKind, GenerationError, ProtocolError
from handlers.protocols.outputs import Failure

M = TypeVar("M", bound=BaseModel)

# pydantic error types -> OpenAI's codes for the same problem
_CODES = {
    "missing": "missing_required_parameter",
    "extra_forbidden": "unknown_parameter",
    "literal_error": "invalid_value",
    "enum": "invalid_value",
    "value_error": "invalid_value",
}
_RANGE_ERRORS = ("greater_than", "less_than", "too_short", "too_long", "multiple_of")


class OpenAIError(ProtocolError):
    """A request the OpenAI protocol refuses or fails."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        kind: ErrorKind = ErrorKind.VALIDATION,
        code: str | None = None,
    ) -> None:
        super().__init__(message, kind)
        self.param = param
        self.code = code

    def payload(self, status: int) -> dict[str, Any]:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}


def model_not_found(model: str, served: str, adapters: Sequence[str] = ()) -> OpenAIError:
    also = f" and its LoRA adapters {', '.join(adapters)}" if adapters else ""
    return OpenAIError(f"The model '{model}' does not exist; this server serves '{served}'"
                       f"{also}.", "model", ErrorKind.NOT_FOUND, "model_not_found")


def check_model(requested: str | None, served: str, adapters: Sequence[str] = ()
                ) -> str | None:
    """The LoRA adapter `model` names (None: the served model, as when it is absent); 404 for
    any other model. The answer's `model` echoes the adapter, as vLLM's does."""
    try:
        return adapter_named(requested, served, adapters)
    except UnknownAdapter:
        raise model_not_found(requested, served, adapters) from None


def not_a_text_model(model: str) -> OpenAIError:
    """A generation request to a server that serves an embedding model only (as OpenAI answers
    chat requests for its embedding models: 404, naming `model`)."""
    return OpenAIError(f"'{model}' is an embedding model: this server generates no text "
                       "(option.task=text-embedding); use /v1/embeddings", "model",
                       ErrorKind.NOT_FOUND)


def generation_failed(failure: Failure | GenerationError) -> OpenAIError:
    """A generation that failed: the engine's reason, unless the engine itself crashed before
    answering (its exception is a bug's detail, not the client's business); a request that
    admission refused says so."""
    if isinstance(failure, GenerationError):
        if failure.crashed:
            return OpenAIError("internal server error", kind=ErrorKind.INTERNAL)
        if failure.kind in REFUSALS:
            return OpenAIError(failure.message, kind=failure.kind)
    return OpenAIError(f"generation failed: {failure.message}", kind=failure.kind)


def param_path(loc: tuple[str | int, ...]) -> str:
    """`("messages", 1, "content", 0, "type")` -> `messages[1].content[0].type`."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else part
    return path


def validate_body(model: type[M], body: Any) -> M:
    """`body` as `model`; OpenAIError (400) when it is not a JSON object or a field is wrong."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def from_validation_error(exc: ValidationError) -> OpenAIError:
    """One error, as OpenAI reports one bad parameter at a time: of a union's failed branches,
    the one that got deepest into the value (e.g. `stop[1]` rather than "not a string")."""
    errors = exc.errors(include_url=False)
    err = max(errors, key=lambda e: len(_field_loc(e["loc"])))
    param = param_path(_field_loc(err["loc"])) or None
    message = err["msg"].removeprefix("Value error, ")
    got = err.get("input")
    if err["type"] != "missing" and _is_scalar(got):
        message += f" (got {got!r})"
    return OpenAIError(f"{param}: {message}" if param else message, param,
                       code=_code(err["type"]))


def _code(error_type: str) -> str:
    if error_type in _CODES:
        return _CODES[error_type]
    if error_type.startswith(_RANGE_ERRORS):
        return "invalid_value"
    return "invalid_type"


def _field_loc(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """`loc` without the union branch names pydantic inserts ("str", "list[constrained-str]",
    "NamedToolChoice", "literal['none','auto']"); OpenAI's fields are lower_snake_case."""
    return tuple(p for p in loc if isinstance(p, int) or p.isdigit()  # a logit_bias key
                 or p.replace("_", "").isalnum() and p.islower() and p not in _TYPE_NAMES)


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)
