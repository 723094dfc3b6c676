"""Reading the raw `key -> (value text, source)` table from the command line, serving.properties
and the environment; a source added earlier wins (command line first, as in DJL)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from jproperties import Properties

from handlers.config.keys import ENV_VARS, ConfigError, canonical_key

CLI = "command line"
PROPERTIES = "serving.properties"
DEFAULT = "default"

Raw = dict[str, tuple[str, str]]  # canonical key -> (value text, source)


def _add(raw: Raw, key: str, value: str, source: str) -> None:
    """Record `key=value` unless a higher-priority source (added earlier) already set it."""
    canonical = canonical_key(key, source)
    if value.strip():  # DJL skips empty values
        raw.setdefault(canonical, (value.strip(), source))


def add_cli(raw: Raw, options: list[str]) -> None:
    """`--option KEY=VALUE` flags; of a key given twice the last wins, as flags do."""
    for option in reversed(options):
        key, sep, value = option.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--option {option!r} ({CLI}): expected KEY=VALUE")
        _add(raw, key.strip(), value, CLI)


def add_flag(raw: Raw, key: str, value: str | None, flag: str) -> None:
    """A command-line flag that stands for a key (`--api-key`); `--option` beats it."""
    if value is not None:
        _add(raw, key, value, f"{CLI} {flag}")


def add_properties(raw: Raw, model_dir: Path) -> None:
    path = model_dir / "serving.properties"
    if not path.is_file():
        return
    props = Properties()
    try:
        with path.open("rb") as file:
            props.load(file, "utf-8")
    except Exception as exc:  # jproperties raises its own parse errors, OSError, UnicodeError
        raise ConfigError(f"{path}: cannot read it: {exc}") from exc
    for key, (value, _meta) in props.items():
        _add(raw, key, value, PROPERTIES)


def add_env(raw: Raw, env: Mapping[str, str]) -> None:
    """`OPTION_<NAME>` / `SERVING_<NAME>` first, then LMI's variables and the aliases."""
    for name, value in sorted(env.items()):
        if name.startswith("OPTION_"):
            _add(raw, "option." + name[len("OPTION_") :], value, f"env {name}")
        elif name.startswith("SERVING_"):
            _add(raw, name[len("SERVING_") :], value, f"env {name}")
    # AWS's vLLM SageMaker image: SM_VLLM_<FIELD> is vLLM's engine argument <field>.
    for name, value in sorted(env.items()):
        if name.startswith("SM_VLLM_") and len(name) > len("SM_VLLM_"):
            _add(raw, "option." + name[len("SM_VLLM_") :].lower(), value, f"env {name}")
    for name, key, translate in ENV_VARS:
        if env.get(name, "").strip():
            try:
                value = translate(env[name].strip())
            except ValueError as exc:
                raise ConfigError(f"env {name}={env[name]!r} is invalid: {exc}") from None
            _add(raw, key, value, f"env {name}")
