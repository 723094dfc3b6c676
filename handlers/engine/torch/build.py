"""Build the torch engine for a configuration (the registry's entry point for `torch`)."""

from __future__ import annotations

import logging
from dataclasses import replace

from handlers.config import Config, ConfigError, chat_template_text, with_source_adapters
from handlers.engine.base import EngineBuild
from handlers.engine.kv_budget import KVBudget, kv_budget
from handlers.engine.loop.direct import DirectStepper
from handlers.engine.loop.speculation import NgramSettings
from handlers.engine.media import MediaLimits
from handlers.engine.media.limits import media_settings_given
from handlers.engine.memory import revoke
from handlers.engine.torch.decode_graphs import DecodeGraphs
from handlers.engine.torch.engine import TorchEngine
from handlers.engine.torch.loader import LoadedModel, load_model
from handlers.engine.torch.lora import LoraSet
from handlers.engine.types import AdapterError
from handlers.model_source import resolve_model_source

# What recent prompts' keys/values may take while kept for reuse (option.enable_prefix_caching,
# on unless set false, as vLLM's): ~11,600 tokens of SmolLM2-135M's float16 cache (the tokens
# follow the cache's bytes per token: ~5,800 in float32, ~23,000 in float8). It comes out of
# the KV budget (kv_budget.py), of which it takes a quarter at most.
PREFIX_CACHE_BYTES = 256 << 20

log = logging.getLogger(__name__)


def build(config: Config) -> EngineBuild:
    speculation = NgramSettings.of(config.speculative_config, config.sources["speculative_config"])
    source = resolve_model_source(config.model_id, config.model_dir, config.revision)
    config = with_source_adapters(config, source)
    loaded = load_model(source, dtype=config.dtype, device=config.device,
                        max_model_len=config.max_model_len,
                        trust_remote_code=config.trust_remote_code, name=config.model_name,
                        quantize=config.quantize)
    prefill = config.max_rolling_batch_prefill_tokens
    if not config.enable_chunked_prefill:  # whole prompts: a step prefills up to the context
        prefill = max(prefill, loaded.max_model_len)
    # vLLM's meaning: option.enforce_eager=true runs the step eagerly, without compiling it
    # (on the CPU) or capturing it as CUDA graphs (on a GPU).
    on_gpu = loaded.device.type == "cuda"
    graphs = None if config.enforce_eager or on_gpu else DecodeGraphs.for_model(
        loaded, config.max_rolling_batch_size, loaded.max_model_len,
        kv_cache_dtype=config.kv_cache_dtype)
    lora = None if config.lora is None else LoraSet(config.lora.max_loras, config.lora.max_rank)
    budget, prefix_bytes = _budget(config, on_gpu)
    try:
        engine = TorchEngine(loaded, max_batch_size=config.max_rolling_batch_size,
                             max_prefill_tokens=prefill, chat_template=chat_template_text(config),
                             stall_timeout=config.engine_stall_timeout or None,
                             prefix_cache_bytes=prefix_bytes, graphs=graphs, lora=lora,
                             cuda_graphs=on_gpu and not config.enforce_eager,
                             media_limits=_media_limits(config, loaded),
                             kv_cache_dtype=config.kv_cache_dtype, kv_budget=budget,
                             speculation=speculation)
        if lora is not None:  # the runner wrapped the model's projections: the adapters fit in
            _add_adapters(config, lora)
    except BaseException:
        revoke(budget and budget.grant)  # no engine holds it
        raise
    if speculation is not None:
        log.info("speculative decoding: up to %d tokens proposed per row and step by n-gram "
                 "lookup (%d to %d tokens matched)", speculation.num_tokens,
                 speculation.lookup_min, speculation.lookup_max)
    return EngineBuild(engine, main_loop=engine.loop, steppable=DirectStepper(engine))


def _budget(config: Config, on_gpu: bool) -> tuple[KVBudget | None, int]:
    """The running sequences' KV budget, measured now the weights are in memory, and the prefix
    cache's bytes, which come out of it. The CPU's only: on a GPU the slot cache is as long as
    its longest sequence in every slot, which a budget of positions does not bound, so there is
    none, and the settings that would size it are refused."""
    prefix_bytes = 0 if config.enable_prefix_caching is False else PREFIX_CACHE_BYTES
    if not on_gpu:
        budget = kv_budget(config)
        prefix_bytes = min(prefix_bytes, budget.bytes // 4)
        return replace(budget, bytes=budget.bytes - prefix_bytes), prefix_bytes
    given = [f"option.{field} ({config.sources[field]})"
             for field in ("kv_cache_memory_bytes", "gpu_memory_utilization")
             if config.sources.get(field, "default") != "default"]
    if given:
        raise ConfigError(f"{', '.join(given)}: the torch engine budgets its KV cache on the "
                          "CPU only; on a GPU its cache has room for every slot at the longest "
                          "sequence's length")
    return None, prefix_bytes


def _media_limits(config: Config, loaded: LoadedModel) -> MediaLimits | None:
    """The media settings' limits; refused for a model that reads text only."""
    if loaded.processor is None:
        if given := media_settings_given(config):
            raise ConfigError(f"{', '.join(given)}: {loaded.name} reads text only; media "
                              "settings apply to multimodal models")
        return None
    return MediaLimits.of(config)


def _add_adapters(config: Config, lora: LoraSet) -> None:
    for adapter in config.adapters:
        try:
            weights = lora.register(adapter.name, adapter.path)
        except AdapterError as exc:
            raise ConfigError(f"LoRA adapter {adapter.name!r} ({adapter.path}, "
                              f"{adapter.source}): {exc}") from None
        log.info("serving LoRA adapter %s: %s (rank %d, %d modules; %s)", adapter.name,
                 adapter.path, weights.rank, len(weights.modules), adapter.source)
