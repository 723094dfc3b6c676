"""Managing LoRA adapters at runtime, in two dialects: DJL Serving's adapter management API
(`/models/{model}/adapters…`, parameters in the query, answers `{"status": …}` and errors
`{"code", "type", "message"}` as DJL's front end writes them) and vLLM's
`/v1/load_lora_adapter` / `/v1/unload_lora_adapter` (JSON bodies, a plain-text success, OpenAI's
error shape). What a request asks is read and checked here; the server resolves the source and
the engine loads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from handlers.protocols.bodies import parse_body
from handlers.protocols.errors import ErrorKind, ProtocolError

# DJL's exception names, by kind, as its error bodies carry them.
_DJL_TYPES = {ErrorKind.NOT_FOUND: "ModelNotFoundException",
              ErrorKind.UNAVAILABLE: "ServiceUnavailableException"}
_BOOLEANS = {"true": True, "false": False}


class DjlManagementError(ProtocolError):
    """DJL Serving's management error body: `{"code", "type", "message"}`."""

    def payload(self, status: int) -> dict[str, Any]:
        kind = _DJL_TYPES.get(self.kind, "BadRequestException" if status < 500
                              else "InternalServerException")
        return {"code": status, "type": kind, "message": self.message}


@dataclass(frozen=True)
class AdapterRecord:
    """What the management API reports of a registered adapter."""

    name: str
    src: str  # as registered (a path, an s3:// URI or a Hub id)
    pin: bool = False

    def described(self) -> dict[str, Any]:
        return {"name": self.name, "src": self.src, "pin": self.pin}


@dataclass(frozen=True)
class Registration:
    name: str
    src: str
    pin: bool


def registration(query: Mapping[str, str]) -> Registration:
    """DJL's register parameters: `name` and `src`, optional `pin` and `preload` (true only:
    an adapter is read when registered); any other is refused, naming it."""
    _refuse_others(query, {"name", "src", "pin", "preload"})
    name, src = query.get("name"), query.get("src")
    if not name or not src:
        raise DjlManagementError("both `name` and `src` are required (POST "
                                 "/models/{model}/adapters?name=NAME&src=PATH)")
    _preload(query)
    return Registration(name, src, _boolean(query, "pin", False))


def update(query: Mapping[str, str]) -> bool | None:
    """DJL's update parameters: the new `pin` (None: unchanged), `preload` true only."""
    _refuse_others(query, {"pin", "preload"})
    _preload(query)
    return _boolean(query, "pin", None)


def page(query: Mapping[str, str], described: list[dict[str, Any]], key: str = "adapters"
         ) -> dict[str, Any]:
    """DJL's (and SageMaker's multi-model) list: `limit` entries (100 unless given) from
    `next_page_token` (an index), under `key`."""
    _refuse_others(query, {"limit", "next_page_token"})
    limit = _index(query, "limit", 100)
    start = _index(query, "next_page_token", 0)
    listed: dict[str, Any] = {key: described[start:start + limit]}
    if start + limit < len(described):
        listed["nextPageToken"] = str(start + limit)
    return listed


class LoadLoraAdapter(BaseModel):
    """vLLM's /v1/load_lora_adapter body."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class LoadModel(BaseModel):
    """SageMaker's multi-model Load Model body: the name to keep the model by, and where it
    lies (SageMaker: /opt/ml/models/<name>/model)."""

    model_config = ConfigDict(extra="forbid")

    model_name: str
    url: str


def load_model_body(body: Any) -> LoadModel:
    """The Load Model body, or DJL's management error naming what is wrong."""
    return parse_body(LoadModel, body, DjlManagementError,
                      'expected a JSON object {"model_name": ..., "url": ...}')


class UnloadLoraAdapter(BaseModel):
    """vLLM's /v1/unload_lora_adapter body (by name: the ids are the engine's own)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str


def vllm_body(kind: type[BaseModel], body: Any, error: type[ProtocolError]) -> Any:
    parsed = parse_body(kind, body, lambda message: error(message),
                        "request body must be a JSON object")
    if isinstance(parsed, LoadLoraAdapter) and parsed.load_inplace:
        raise error("load_inplace: replacing a served adapter's weights in place is not "
                    "supported; unload it, then load it again")
    return parsed


def _refuse_others(query: Mapping[str, str], known: set[str]) -> None:
    others = sorted(set(query) - known)
    if others:
        raise DjlManagementError(f"unknown parameter {others[0]!r}: this API takes "
                                 f"{', '.join(sorted(known))}")


def _preload(query: Mapping[str, str]) -> None:
    if not _boolean(query, "preload", True):
        raise DjlManagementError("preload=false is not supported: an adapter is read and "
                                 "checked when it is registered")


def _boolean(query: Mapping[str, str], key: str, default: bool | None) -> bool | None:
    value = query.get(key)
    if value is None:
        return default
    if value.lower() not in _BOOLEANS:
        raise DjlManagementError(f"{key}={value!r}: expected true or false")
    return _BOOLEANS[value.lower()]


def _index(query: Mapping[str, str], key: str, default: int) -> int:
    value = query.get(key)
    if value is None:
        return default
    if not value.isdigit():
        raise DjlManagementError(f"{key}={value!r}: expected a non-negative integer")
    return int(value)
