"""Settings that could not take effect with the rest of the configuration stop startup here,
before anything loads; whether the chosen engine supports the engine settings is the engine
registry's question (handlers/engine/registry.py)."""

from __future__ import annotations

from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes

from handlers.config.keys import BY_FIELD, ConfigError, Setting
from handlers.config.settings import Config
from handlers.model_source import is_remote

OWN_ENTRY_POINT = "handlers.djl"

# Settings that shape the LLM's answers, meaningless on a server that serves embeddings only.
_GENERATION_ONLY = ("rolling_batch", "output_formatter", "tgi_compat", "enable_streaming",
                    "full_text_enabled", "chat_template", "batch_size", "max_batch_delay",
                    "max_consecutive_failures", "reasoning_parser", "tool_call_parser",
                    "enable_auto_tool_choice", "enable_stateful_sessions",
                    "sessions_expiration", "max_sessions", "max_sessions_per_client",
                    "max_models", "max_client_batch_size", "allow_runtime_fetch")
_ROLLING_ONLY = ("output_formatter", "tgi_compat")
_DYNAMIC_ONLY = ("max_batch_delay", "enable_streaming")


def check_effects(config: Config) -> None:
    """Raise ConfigError for a setting that nothing would read."""
    hub = config.model_id is not None and not config.model_id.startswith("s3://") and \
        is_remote(config.model_id, config.model_dir)
    if config.revision is not None and not hub:
        _refuse(config, BY_FIELD["revision"], "it picks a Hugging Face Hub revision, and "
                "option.model_id names no Hub model")
    if config.entry_point not in (None, OWN_ENTRY_POINT):
        _refuse(config, BY_FIELD["entry_point"], "lmi-serve answers with its own handlers; a "
                f"custom entry point runs inside DJL Serving (use {OWN_ENTRY_POINT} there)")
    if config.embeddings_only:
        _refuse_if_set(config, "embedding_model_id", "it names an LLM server's companion "
                       "embedding model; option.task=text-embedding serves option.model_id's")
        _refuse_if_set(config, "otlp_traces_endpoint", "it traces generation requests, and "
                       "option.task=text-embedding serves none")
        reason = "it shapes text generation, and option.task=text-embedding serves no LLM"
        for field in _GENERATION_ONLY:
            _refuse_if_set(config, field, reason)
        for setting in BY_FIELD.values():
            if setting.engine and config.is_set(setting):
                _refuse(config, setting, reason)
        if config.adapters:
            adapter = config.adapters[0]
            raise ConfigError(f"LoRA adapter {adapter.name!r} ({adapter.source}) would have no "
                              f"effect: {reason}")
        return
    mode = "dynamic batching (option.rolling_batch=disable)"
    if config.dynamic_batching:
        for field in _ROLLING_ONLY:
            _refuse_if_set(config, field, f"it does not apply to {mode}")
    else:
        for field in _DYNAMIC_ONLY:
            _refuse_if_set(config, field, f"it applies to {mode} only")
        if config.tgi_compat and config.output_formatter == "jsonlines":
            _refuse(config, BY_FIELD["output_formatter"], "option.tgi_compat streams TGI's "
                    "server-sent events")
    _check_sessions(config)
    chat_template_text(config)


def _check_sessions(config: Config) -> None:
    per_client = config.max_sessions_per_client
    if per_client is None:
        return
    if not config.enable_stateful_sessions:
        _refuse(config, BY_FIELD["max_sessions_per_client"], "it bounds stateful sessions, and "
                "option.enable_stateful_sessions=false")
    if per_client > config.max_sessions:
        _refuse(config, BY_FIELD["max_sessions_per_client"], "it is more than "
                f"option.max_sessions={config.max_sessions}, which bounds every client's "
                "sessions together")


def _refuse_if_set(config: Config, field: str, reason: str) -> None:
    setting = BY_FIELD[field]
    if config.is_set(setting):
        _refuse(config, setting, reason)


def _refuse(config: Config, setting: Setting, reason: str) -> None:
    value = getattr(config, setting.field)
    raise ConfigError(f"{setting.key}={value} ({config.sources[setting.field]}) would have no "
                      f"effect: {reason}; unset it")


def chat_template_text(config: Config) -> str | None:
    """option.chat_template's Jinja text: a file (relative to the model directory), else the
    template itself; ConfigError when it is neither or does not parse."""
    value = config.chat_template
    if value is None:
        return None
    where = f"option.chat_template ({config.sources['chat_template']})"
    path = Path(value).expanduser()
    path = path if path.is_absolute() else config.model_dir / path
    if "{" not in value and "\n" not in value:  # vLLM's test: a path unless it looks like Jinja
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeError) as exc:
            raise ConfigError(f"{where} names no readable template file: {exc}") from None
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _GenerationTag]).parse(value)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{where} is not a valid Jinja template: {exc}") from None
    return value


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` block (it marks assistant text)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)
