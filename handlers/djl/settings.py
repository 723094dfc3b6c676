"""DJL Serving's model properties, as `handle()` receives them, read into this project's Config.

DJL passes `serving.properties`' `option.*` keys without their prefix (`model_id`,
`rolling_batch`, ...), mixed with its own keys (`model_dir`, `device_id`, `batch_size` and the
`batch_NNN_*` keys of a batch). Only the keys that are `option.*` settings here are taken; the
rest belong to DJL. Neither serving.properties nor the environment is read again: DJL already
folded them into the properties, and the file may hold DJL keys this project does not know.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from handlers.config import SETTINGS, Config, ConfigError, load_config, parse_args
from handlers.config.sources import DEFAULT
from handlers.engine import registry

# DJL's front end itself applies these (it found this entry point, times loading and each call).
_DJL_OWN = {"option.entryPoint", "option.model_loading_timeout", "option.predict_timeout"}
_OPTIONS = {s.key for s in SETTINGS if s.key.startswith("option.")} - _DJL_OWN
# What only lmi-serve's own routes read: the DJL entry answers LMI's schema alone.
_SERVER_ONLY = ("full_text_enabled", "chat_template", "embedding_model_id", "api_key",
                "reasoning_parser", "tool_call_parser", "enable_auto_tool_choice",
                "otlp_traces_endpoint", "sessions_expiration", "max_sessions", "max_models",
                "max_client_batch_size", "max_sessions_per_client", "allow_runtime_fetch",
                "enable_ui")


def is_rolling(properties: Mapping[str, Any]) -> bool:
    """Whether DJL drives this model in rolling-batch mode: its own test, on the raw value."""
    value = properties.get("rolling_batch")
    return value is not None and value != "disable"


def config_from_properties(properties: Mapping[str, Any]) -> Config:
    """The effective settings; raises ConfigError for a value that does not parse."""
    argv: list[str] = []
    model_dir = properties.get("model_dir")
    if model_dir:
        argv += ["--model-dir", str(model_dir)]
    for key, value in _options(properties).items():
        argv += ["--option", f"{key}={value}"]
    return load_config(parse_args(argv), env={}, read_properties=False)


def _options(properties: Mapping[str, Any]) -> dict[str, str]:
    options = {
        f"option.{key}": str(value)
        for key, value in properties.items()
        # Values may be objects DJL put there (a custom output formatter function).
        if f"option.{key}" in _OPTIONS and isinstance(value, str | int | float)
    }
    if str(properties.get("rolling_batch")) in ("vllm", "lmi-dist"):
        # As DJL's vLLM handler: the properties that name vLLM engine arguments are passed on.
        fields = registry.argument_names("vllm")
        options |= {f"option.{key}": str(value) for key, value in properties.items()
                    if key in fields and f"option.{key}" not in _OPTIONS | _DJL_OWN}
    device = _device(properties.get("device_id"))
    if device is not None:
        options.setdefault("option.device", device)
    return options


def _device(device_id: Any) -> str | None:
    """DJL's worker device: -1 is the CPU, N is GPU N."""
    try:
        index = int(device_id)
    except (TypeError, ValueError):
        return None
    return "cpu" if index < 0 else f"cuda:{index}"


def check_djl_effects(config: Config) -> None:
    """Refuse the settings only lmi-serve's own routes would read (stateful sessions too: the
    DJL entry keeps none, so asking for them is refused and turning them off is accepted)."""
    if config.enable_stateful_sessions and \
            config.sources["enable_stateful_sessions"] != DEFAULT:
        raise ConfigError("option.enable_stateful_sessions=true would have no effect: the DJL "
                          "entry keeps no sessions (lmi-serve's own server does); unset it")
    for setting in SETTINGS:
        if setting.field in _SERVER_ONLY and config.is_set(setting):
            value = "<set>" if setting.field == "api_key" else getattr(config, setting.field)
            raise ConfigError(
                f"{setting.key}={value} would have no effect: the DJL entry answers LMI's "
                "schema only (lmi-serve serves the OpenAI and embedding routes, and DJL's "
                "front end its HTTP); unset it")
