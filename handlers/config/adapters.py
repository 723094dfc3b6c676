"""The LoRA adapters to serve: every `<model_dir>/adapters/<name>/` holding an
`adapter_config.json` (DJL LMI's convention), and the `name=path` pairs of option.lora_modules
(vLLM's server option). Each is read at startup, far enough to size vLLM's LoRA slots (its
rank) and to stop startup on a missing or unreadable adapter rather than fail its requests later.
The torch and vllm engines serve adapters (handlers/engine/registry.py refuses them elsewhere);
`lora_limits` settles option.enable_lora, option.max_loras and option.max_lora_rank for both.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handlers.config import values
from handlers.config.keys import ConfigError
from handlers.model_source import ModelSourceError, fetch, is_remote

log = logging.getLogger(__name__)

# DJL LMI's defaults (vLLM's max_loras is 1, but LMI passes 4).
DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 16
ADAPTERS_DIR = "adapters"
CONFIG_FILE = "adapter_config.json"
# The weight files vLLM's LoRA loader reads, in its order of preference.
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")


@dataclass(frozen=True)
class Adapter:
    name: str  # what requests select it by
    path: Path
    rank: int  # its largest LoRA rank: `r`, or a larger one in `rank_pattern` (as vLLM reads it)
    source: str  # where it was named: the model directory, or option.lora_modules


@dataclass(frozen=True)
class LoraLimits:
    max_loras: int  # the adapters one batch may mix (more may be served)
    max_rank: int
    rank_given: bool  # max_rank was set (else the default, or the largest adapter's rank)


def lora_limits(settings: Mapping[str, Any], sources: Mapping[str, str],
                adapters: tuple[Adapter, ...]) -> LoraLimits | None:
    """LoRA's limits, or None when LoRA is off; ConfigError when the adapters configured do not
    fit them."""
    enabled = settings["enable_lora"]
    if enabled is False and adapters:
        raise ConfigError(f"option.enable_lora=false ({sources['enable_lora']}) turns LoRA off, "
                          f"but LoRA adapter {adapters[0].name!r} ({adapters[0].source}) is "
                          "configured: remove one or the other")
    if not enabled and not adapters:
        for key in ("max_loras", "max_lora_rank"):
            if settings[key] is not None:
                raise ConfigError(f"option.{key}={settings[key]} ({sources[key]}) has no effect "
                                  "with LoRA off: set option.enable_lora=true or add adapters")
        return None
    max_loras = settings["max_loras"] or DEFAULT_MAX_LORAS
    given = settings["max_lora_rank"]
    largest = max(adapters, key=lambda a: a.rank, default=None)
    if given is not None and largest is not None and largest.rank > given:
        raise ConfigError(f"option.max_lora_rank={given} ({sources['max_lora_rank']}) is below "
                          f"the rank {largest.rank} of LoRA adapter {largest.name!r} "
                          f"({largest.path})")
    rank = given or max(DEFAULT_MAX_LORA_RANK, largest.rank if largest else 0)
    return LoraLimits(max_loras, rank, given is not None)


def find_adapters(model_dir: Path, lora_modules: str | None, modules_source: str,
                  model_name: str) -> tuple[Adapter, ...]:
    """The model directory's adapters, then option.lora_modules' (an s3:// URI or a Hub id is
    fetched into the model cache now, as a model is); ConfigError naming the one that is
    missing, unreadable, cannot be fetched, or is named twice (or as the base model)."""
    found = [*_in_model_dir(model_dir)]
    for name, path in module_pairs(lora_modules, modules_source):
        source = f"option.lora_modules ({modules_source})"
        if is_remote(path, model_dir):
            found.append(read_adapter(name, _fetched(name, path, source),
                                      f"{source}, fetched from {path}"))
            continue
        folder = Path(path).expanduser()
        found.append(read_adapter(name, folder if folder.is_absolute() else model_dir / folder,
                                  source))
    _check_names(found, model_name)
    return tuple(found)


def with_model_adapters(config_adapters: tuple[Adapter, ...], model_dir: Path,
                        source: Path, model_name: str) -> tuple[Adapter, ...]:
    """The adapters configured, and those in the `adapters/` folder of the model files
    themselves (`source`: an s3:// or Hub model once fetched, or option.model_id's directory)
    where that is not the model directory, as DJL LMI finds them in either."""
    if not source.is_dir() or source.resolve() == model_dir.resolve():
        return config_adapters
    found = [*config_adapters, *_in_model_dir(source)]
    _check_names(found, model_name)
    return tuple(found)


def _fetched(name: str, uri: str, source: str) -> Path:
    try:
        return fetch(uri)
    except ModelSourceError as exc:
        raise ConfigError(f"LoRA adapter {name!r} ({uri}, {source}): {exc}") from None


def module_pairs(text: str | None, source: str) -> list[tuple[str, str]]:
    """option.lora_modules' `name=path` pairs, separated by commas (or whitespace, as vLLM's
    --lora-modules takes them)."""
    pairs = []
    for item in re.split(r"[,\s]+", (text or "").strip()):
        name, sep, path = item.partition("=")
        if item and not (sep and name and path):
            raise ConfigError(f"option.lora_modules={text!r} ({source}): {item!r} is not a "
                              "name=path pair (expected comma-separated name=path pairs)")
        if item:
            pairs.append((name, path))
    return pairs


def read_adapter(name: str, path: Path, source: str) -> Adapter:
    """The adapter in `path`, read as vLLM will: a PEFT LoRA config, and weights beside it."""
    where = f"LoRA adapter {name!r} ({path}, {source})"
    try:
        values.model_name(name)  # a model id in OpenAI's `model`, and a URL segment
    except ValueError as exc:
        raise ConfigError(f"{where}: its name is unusable: {exc}") from None
    if not path.is_dir():
        raise ConfigError(f"{where}: no such directory")
    try:
        config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeError, ValueError) as exc:
        raise ConfigError(f"{where}: cannot read its {CONFIG_FILE}: {exc}") from None
    if not any((path / weights).is_file() for weights in WEIGHT_FILES):
        raise ConfigError(f"{where}: holds no adapter weights ({' or '.join(WEIGHT_FILES)})")
    return Adapter(name, path.resolve(), _rank(config, where), source)


def _in_model_dir(model_dir: Path) -> list[Adapter]:
    root = model_dir / ADAPTERS_DIR
    if not root.is_dir():
        return []
    try:
        folders = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError as exc:
        raise ConfigError(f"the model directory's {ADAPTERS_DIR}/ cannot be read: {exc}") from None
    found = []
    for folder in folders:
        if (folder / CONFIG_FILE).is_file():
            found.append(read_adapter(folder.name, folder, f"found in {root}"))
        else:  # as DJL LMI: only a folder with an adapter config is an adapter
            log.info("%s holds no %s: not a LoRA adapter", folder, CONFIG_FILE)
    return found


def _rank(config: Any, where: str) -> int:
    kind = config.get("peft_type", "LORA") if isinstance(config, dict) else None
    if kind is None or str(kind).upper() != "LORA":
        raise ConfigError(f"{where}: {CONFIG_FILE} describes no LoRA adapter (peft_type "
                          f"{kind!r}); vLLM serves LoRA adapters only")
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    if not all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in ranks):
        raise ConfigError(f"{where}: {CONFIG_FILE} has no positive integer rank `r` "
                          f"(r={config.get('r')!r}, rank_pattern={config.get('rank_pattern')!r})")
    return max(ranks)


def _check_names(found: list[Adapter], model_name: str) -> None:
    seen: dict[str, Adapter] = {}
    for adapter in found:
        if adapter.name == model_name:
            raise ConfigError(f"LoRA adapter {adapter.name!r} ({adapter.source}) has the served "
                              "model's name; requests could not select one or the other")
        if adapter.name in seen:
            raise ConfigError(f"LoRA adapter {adapter.name!r} is named twice: "
                              f"{seen[adapter.name].path} ({seen[adapter.name].source}) and "
                              f"{adapter.path} ({adapter.source})")
        seen[adapter.name] = adapter
