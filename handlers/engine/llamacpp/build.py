"""Build the llama.cpp engine for a configuration (the registry's entry point for `llamacpp`):
the shared engine loop and continuous batcher (admission, chunked prefill, sampling, structured
output, detokenization: handlers/engine/loop/) over a runner whose forward passes are llama.cpp's.
"""

from __future__ import annotations

import logging

from handlers.config import Config, chat_template_text
from handlers.engine.base import EngineBuild
from handlers.engine.llamacpp.kv_types import kv_type
from handlers.engine.llamacpp.model import LlamaCppModel, load_model
from handlers.engine.llamacpp.runner import LlamaCppRunner
from handlers.engine.loop.direct import DirectStepper
from handlers.engine.loop.engine import LoopEngine
from handlers.model_source import resolve_model_source

log = logging.getLogger(__name__)

# The KV pool is allocated (and zeroed) up front: every slot at full length, or this much.
KV_POOL_BYTES = 1 << 30
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ
# Prompt prefixes kept for reuse (option.enable_prefix_caching, on unless set false): in spare
# sequences of the pool, holding at most this share of its cells.
PREFIX_PLACES = 8
PREFIX_POOL_SHARE = 8  # 1/8


def build(config: Config) -> EngineBuild:
    slots = config.max_rolling_batch_size
    if slots > MAX_SEQUENCES:
        raise ValueError(f"option.max_rolling_batch_size={slots}: llama.cpp runs at most "
                         f"{MAX_SEQUENCES} sequences at once")
    source = resolve_model_source(config.model_id, config.model_dir, config.revision)
    if source.suffix.lower() != ".gguf":
        raise ValueError(f"the llama.cpp engine serves GGUF files; {source} is not one")
    kv = kv_type(config.kv_cache_dtype)
    model = load_model(source, name=config.model_name, max_model_len=config.max_model_len,
                       kv_type=kv)
    log.info("option.kv_cache_dtype=%s: llama.cpp caches keys and values in %s (%s), %d bytes "
             "per token", config.kv_cache_dtype, kv.name, kv.why, model.kv_bytes_per_token)
    prefill = config.max_rolling_batch_prefill_tokens
    if not config.enable_chunked_prefill:  # whole prompts: a step prefills up to the context
        prefill = max(prefill, model.max_model_len)
    pool = pool_tokens(model, slots)
    log.info("llama.cpp engine: %d sequences share a KV pool of %d tokens (%d MiB); "
             "up to %d tokens per pass", slots, pool, pool * model.kv_bytes_per_token >> 20,
             max(prefill, slots))

    places = 0 if config.enable_prefix_caching is False else min(PREFIX_PLACES,
                                                                 MAX_SEQUENCES - slots)

    def new_runner() -> LlamaCppRunner:
        return LlamaCppRunner(model, slots, max(prefill, slots), pool, places)

    prefix_bytes = pool * model.kv_bytes_per_token // PREFIX_POOL_SHARE if places else 0
    engine = LoopEngine(model, new_runner, max_batch_size=slots, max_prefill_tokens=prefill,
                        chat_template=chat_template_text(config),
                        stall_timeout=config.engine_stall_timeout or None,
                        prefix_cache_bytes=prefix_bytes)
    engine.kv_cache_dtype = kv.name  # GGML's name, as GET /config shows it
    return EngineBuild(engine, main_loop=engine.loop, steppable=DirectStepper(engine))


def pool_tokens(model: LlamaCppModel, slots: int) -> int:
    """KV cells for all sequences together: each at full length where that fits in
    KV_POOL_BYTES, else as many as fit (never less than one full-length sequence)."""
    fits = KV_POOL_BYTES // model.kv_bytes_per_token
    return min(slots * model.max_model_len, max(model.max_model_len, fits))
