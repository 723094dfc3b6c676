"""Every lmi-serve setting, in DJL Serving's key names, with where each value came from; a
setting either takes effect or stops startup (`check_effects`, and the engine registry)."""

from handlers.config.args import Line, config_lines, log_config, parse_args
from handlers.config.effects import OWN_ENTRY_POINT, chat_template_text, check_effects
from handlers.config.keys import SETTINGS, TEXT_EMBEDDING, ConfigError, Setting
from handlers.config.model import REPO_DIR, resolve_model_dir
from handlers.config.settings import Config, load_config, with_source_adapters

__all__ = [
    "OWN_ENTRY_POINT",
    "REPO_DIR",
    "SETTINGS",
    "TEXT_EMBEDDING",
    "Config",
    "ConfigError",
    "Line",
    "Setting",
    "chat_template_text",
    "config_lines",
    "check_effects",
    "load_config",
    "log_config",
    "parse_args",
    "resolve_model_dir",
    "with_source_adapters",
]
