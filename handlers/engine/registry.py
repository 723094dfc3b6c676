"""`option.rolling_batch` -> the engine that serves it, imported only once chosen (so the server
imports no torch, vLLM or llama.cpp of its own). Each entry says which engine settings take
effect with it; another engine setting stops startup unless it holds a value meaning the default.
LMI's dynamic batching (`disable`) is composed here, over the default engine.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from handlers.config import SETTINGS, Config, ConfigError, Setting
from handlers.engine.base import EngineBuild
from handlers.engine.dynamic_batch import DynamicBatcher


@dataclass(frozen=True)
class EngineEntry:
    name: str
    module: str | None  # has `build(config) -> EngineBuild`; None: not in this build yet
    supports: frozenset[str]  # the engine settings (Setting.engine) that take effect with it


_ROLLING = frozenset({"option.max_rolling_batch_size", "option.max_rolling_batch_prefill_tokens",
                      "option.enable_chunked_prefill", "option.max_model_len"})
_HF = frozenset({"option.dtype", "option.device", "option.trust_remote_code"})
_SUPERVISED = frozenset({"option.engine_restart", "option.engine_stall_timeout"})
_GPU = frozenset({"option.tensor_parallel_degree", "option.pipeline_parallel_degree",
                  "option.quantize", "option.gpu_memory_utilization", "option.enforce_eager",
                  "option.enable_prefix_caching", "option.disable_sliding_window",
                  "option.cpu_offload_gb_per_gpu", "option.load_format", "engine"})

ENGINES = {
    # The torch engine runs eagerly, always: option.enforce_eager=true is what it does.
    "torch": EngineEntry("torch", "handlers.engine.torch.build",
                         _ROLLING | _HF | _SUPERVISED | {"option.enforce_eager"}),
    "vllm": EngineEntry("vllm", None, _ROLLING | _HF | _GPU),
    "llamacpp": EngineEntry("llamacpp", None, _ROLLING),
}
# option.rolling_batch -> engine; `disable` runs LMI's dynamic batching over the default one.
_BY_MODE = {"auto": "torch", "torch": "torch", "disable": "torch", "vllm": "vllm",
            "llamacpp": "llamacpp"}


def check(config: Config) -> EngineEntry:
    """The engine `option.rolling_batch` asks for; ConfigError when this build lacks it or it
    does not support an engine setting given."""
    entry = ENGINES[_BY_MODE[config.rolling_batch]]
    if entry.module is None:
        built = sorted(mode for mode, name in _BY_MODE.items() if ENGINES[name].module)
        raise ConfigError(
            f"option.rolling_batch={config.rolling_batch} ({config.sources['rolling_batch']}) "
            f"asks for the {entry.name} engine, which this build does not include yet "
            f"(available: {', '.join(built)})")
    for setting in SETTINGS:
        if setting.engine and setting.key not in entry.supports and _departs(config, setting):
            _refuse(config, setting, entry)
    return entry


def loader(config: Config) -> Callable[[], EngineBuild]:
    """Check the configuration and import the chosen engine (here, in the calling thread:
    transformers' lazy imports race when two threads import it at once); the call it returns
    loads the model into it (slow: run it off the event loop)."""
    entry = check(config)
    module = importlib.import_module(entry.module)

    def load() -> EngineBuild:
        built: EngineBuild = module.build(config)
        if not config.dynamic_batching:
            return built
        batcher = DynamicBatcher(built.engine, config.batch_size, config.max_batch_delay)
        return EngineBuild(batcher, built.main_loop, built.steppable)

    return load


def build(config: Config) -> EngineBuild:
    """The chosen engine with the model loaded."""
    return loader(config)()


def _departs(config: Config, setting: Setting) -> bool:
    """Whether the setting asks for other than the default (SageMaker sets the parallel degree
    to its GPU count: `max`, or the count, on one device or none means the default)."""
    if setting.field == "tensor_parallel_degree":
        return config.tensor_parallel_degree not in (1, "max") or (
            config.tensor_parallel_degree == "max" and _gpu_count() > 1)
    return config.is_set(setting)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _refuse(config: Config, setting: Setting, entry: EngineEntry) -> None:
    others = [other.name + ("" if other.module else " (not in this build yet)")
              for other in ENGINES.values() if other is not entry and setting.key in other.supports]
    value = getattr(config, setting.field)
    raise ConfigError(
        f"{setting.key}={value} ({config.sources[setting.field]}) is not supported by the "
        f"{entry.name} engine (supported by: {', '.join(others) or 'no engine of this build'})")
