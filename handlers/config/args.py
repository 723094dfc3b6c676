"""The command line, and the startup log of the effective configuration."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

from handlers.config import values
from handlers.config.keys import SETTINGS
from handlers.config.settings import FLAG_DEFAULTS, Config

_LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]


def _flag(parse: values.Parser) -> values.Parser:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    return convert


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`lmi-serve [serve] [--model-dir DIR] [--host H] [--port P] ... [--option KEY=VALUE]...`"""
    parser = argparse.ArgumentParser(
        prog="lmi-serve", description="Serve an LLM over every major inference protocol."
    )
    add = parser.add_argument
    add("command", nargs="?", choices=["serve"], help="ignored (SageMaker runs `serve`)")
    add("--model-dir", help="default: /opt/ml/model if it exists, else the repository's top level")
    add("--host", default=FLAG_DEFAULTS["host"], help="default: 0.0.0.0")
    add("--port", type=_flag(values.port(1)), help="default: $SAGEMAKER_BIND_TO_PORT, else 8080")
    add("--grpc-port", type=_flag(values.port(0)), default=FLAG_DEFAULTS["grpc_port"],
        help="KServe V2 over gRPC; default: 8081; 0 turns gRPC off")
    add("--log-level", type=str.lower, default=FLAG_DEFAULTS["log_level"], choices=_LOG_LEVELS)
    add("--api-key", help="require this key (Authorization: Bearer, or x-api-key) on every "
        "route but health; as option.api_key")
    add("--otlp-traces-endpoint", help="export OpenTelemetry traces of requests to this OTLP "
        "endpoint (grpc, or http/protobuf by OTEL_EXPORTER_OTLP_TRACES_PROTOCOL); as "
        "option.otlp_traces_endpoint")
    add("--option", action="append", default=[], metavar="KEY=VALUE",
        help="a serving.properties setting, beating every other source (repeatable)")
    return parser.parse_args(argv)


_LABELS = {
    "model_dir": "--model-dir",
    "model_files": "model files",
    "gguf_file": "GGUF file",
    **{setting.field: setting.key for setting in SETTINGS},
    "host": "--host",
    "port": "--port",
    "grpc_port": "--grpc-port",
    "log_level": "--log-level",
}


_SECRETS = {"api_key"}  # shown as set or not, never the value


@dataclass(frozen=True)
class Line:
    """One effective value as startup logs it and `GET /config` reports it: its key, its value
    as text (a secret as `<set>`), where it came from, and what it is when not a setting."""

    key: str
    value: str
    source: str
    note: str = ""  # e.g. "a DJL setting with no effect here"


def config_lines(config: Config) -> list[Line]:
    """Every effective value with where it came from; secrets never shown."""
    lines = []
    for field, label in _LABELS.items():
        value = getattr(config, field)
        if field in _SECRETS and value is not None:
            value = "<set>"
        lines.append(Line(label, str(value), config.sources[field]))
    for key, (value, source) in config.ignored.items():
        lines.append(Line(key, value, source, "a DJL setting with no effect here"))
    for name, (value, source) in config.engine_args.items():
        shown = "<set>" if "token" in name or "key" in name else value  # hf_token and the like
        lines.append(Line(f"option.{name}", shown, source, "an engine argument by name"))
    return lines


def log_config(config: Config, logger: logging.Logger) -> None:
    """Log one line per effective value, with where it came from."""
    for line in config_lines(config):
        note = f"; {line.note}" if line.note else ""
        logger.info("config %s = %s [%s%s]", line.key, line.value, line.source, note)
