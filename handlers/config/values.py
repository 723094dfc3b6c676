"""Value parsers: each takes a setting's stripped text and raises ValueError("expected ...")."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

Parser = Callable[[str], Any]


def text(value: str) -> str:
    return value


def boolean(value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise ValueError("expected true or false")
    return value.lower() == "true"


def streaming(value: str) -> bool:
    # DJL also accepts "huggingface" (its old streaming mode); any streaming mode means on.
    return True if value.lower() == "huggingface" else boolean(value)


def integer(minimum: int) -> Parser:
    def parse(value: str) -> int:
        if not re.fullmatch(r"[+-]?\d+", value) or int(value) < minimum:
            raise ValueError(f"expected an integer >= {minimum}")
        return int(value)

    return parse


def optional_integer(value: str) -> int | None:
    """An integer >= 1, or none / auto for "not set"."""
    return None if value.lower() in ("none", "auto") else integer(1)(value)


def number(minimum: float) -> Parser:
    def parse(value: str) -> float:
        try:
            parsed = float(value)
        except ValueError:
            parsed = float("nan")
        if not parsed >= minimum:  # also refuses nan
            raise ValueError(f"expected a number >= {minimum:g}")
        return parsed

    return parse


def fraction(value: str) -> float:
    try:
        parsed = float(value)
    except ValueError:
        parsed = float("nan")
    if not 0.0 < parsed <= 1.0:  # also refuses nan
        raise ValueError("expected a number in (0, 1]")
    return parsed


def choice(*allowed: str, aliases: Mapping[str, str] | None = None) -> Parser:
    table = {name.lower(): name for name in allowed}
    table |= {name.lower(): target for name, target in (aliases or {}).items()}
    names = ", ".join([*allowed, *(aliases or {})])

    def parse(value: str) -> str:
        if value.lower() not in table:
            raise ValueError(f"expected one of {names}")
        return table[value.lower()]

    return parse


MODALITIES = ("image", "video", "audio")


def modality_counts(value: str) -> dict[str, int]:
    """vLLM's `--limit-mm-per-prompt` as DJL LMI writes it: `image=2,video=1` (JSON too)."""
    value = value.strip()
    if value.startswith("{"):
        try:
            pairs = [(str(k), str(v)) for k, v in json.loads(value).items()]
        except (ValueError, AttributeError):
            raise ValueError("expected modality=count pairs, e.g. image=2,video=1") from None
    else:
        pairs = [tuple(p.split("=", 1)) if "=" in p else (p, "")
                 for p in value.split(",") if p.strip()]
    counts = {}
    for name, count in pairs:
        name = name.strip().lower()
        if name not in MODALITIES or not re.fullmatch(r"\d+", count.strip()):
            raise ValueError(f"expected modality=count pairs, the modalities "
                             f"{', '.join(MODALITIES)}, e.g. image=2,video=1 (got {name}={count})")
        counts[name] = int(count)
    return counts


_SPEC_COUNTS = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def speculative_config(value: str) -> dict[str, Any]:
    """vLLM's `speculative_config`, a JSON object: a `method` (ngram, ...) or a draft `model`,
    its counts whole numbers >= 1 and prompt_lookup_min <= prompt_lookup_max. Which methods an
    engine runs is the engine's question."""
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError('expected a JSON object, e.g. {"method": "ngram", '
                         '"num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    for key in _SPEC_COUNTS:
        count = parsed.get(key)
        if key in parsed and (isinstance(count, bool) or not isinstance(count, int)
                              or count < 1):
            raise ValueError(f"expected {key} to be an integer >= 1 (got {count!r})")
    low, high = parsed.get("prompt_lookup_min"), parsed.get("prompt_lookup_max")
    if low is not None and high is not None and low > high:
        raise ValueError(f"expected prompt_lookup_min <= prompt_lookup_max (got {low} > {high})")
    for key in ("method", "model"):
        if key in parsed and not (isinstance(parsed[key], str) and parsed[key].strip()):
            raise ValueError(f"expected {key} to be a non-empty string (got {parsed[key]!r})")
    if "method" not in parsed and "model" not in parsed:
        raise ValueError('expected a "method" (e.g. "ngram") or a draft "model"')
    return parsed


def domain_list(value: str) -> tuple[str, ...]:
    """Host names, comma-separated (vLLM's `--allowed-media-domains`)."""
    domains = tuple(d.strip().lower() for d in value.split(",") if d.strip())
    if not domains or not all(re.fullmatch(r"[a-z0-9.\-]+", d) for d in domains):
        raise ValueError("expected host names, comma-separated, e.g. example.com,cdn.example.com")
    return domains


def parallel_degree(value: str) -> int | Literal["max"]:
    return "max" if value.lower() == "max" else integer(1)(value)


def device(value: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value.lower()):
        raise ValueError("expected auto, cpu, cuda or cuda:N")
    return value.lower()


def model_name(value: str) -> str:
    # The name is a URL path segment in every protocol's routes.
    if not re.fullmatch(r"[\w.\-:]+", value):
        raise ValueError("expected letters, digits and . _ - : only")
    return value


def port(minimum: int) -> Parser:
    def parse(value: str) -> int:
        parsed = integer(minimum)(value)
        if parsed > 65535:
            raise ValueError(f"expected a port number in [{minimum}, 65535]")
        return parsed

    return parse


OTLP_PROTOCOLS = ("grpc", "http/protobuf")


def otlp_protocol(env: Mapping[str, str]) -> str:
    """The OTLP wire the OpenTelemetry SDK's variables ask for traces to use (vLLM's default:
    grpc); ValueError for one the SDK has no exporter for."""
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
    if protocol not in OTLP_PROTOCOLS:
        raise ValueError(f"OTLP protocol {protocol!r} is not one of {', '.join(OTLP_PROTOCOLS)}")
    return protocol
