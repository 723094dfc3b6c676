"""The torch engine: the shared engine loop (handlers/engine/loop/) over a `ModelRunner`, the
forward passes of a Hugging Face causal LM (CPU by default, CUDA when present), with its decode
steps compiled into graphs where `graphs` is given (on the CPU) or captured as CUDA graphs where
`cuda_graphs` is set, and LoRA adapters applied per row where
`lora` is given (lora.py)."""

from __future__ import annotations

import logging

from handlers.engine import memory
from handlers.engine.kv_budget import KVBudget
from handlers.engine.loop.engine import LoopEngine
from handlers.engine.loop.speculation import NgramSettings
from handlers.engine.media import MediaLimits
from handlers.engine.torch import kv_dtype
from handlers.engine.torch.decode_graphs import DecodeGraphs
from handlers.engine.torch.loader import LoadedModel
from handlers.engine.torch.lora import LoraSet
from handlers.engine.torch.media_prompts import MediaPrompts
from handlers.engine.torch.model_runner import ModelRunner

log = logging.getLogger(__name__)


class TorchEngine(LoopEngine):
    def __init__(self, loaded: LoadedModel, max_batch_size: int = 32,
                 max_prefill_tokens: int = 512, chat_template: str | None = None,
                 stall_timeout: float | None = None, prefix_cache_bytes: int = 0,
                 graphs: DecodeGraphs | None = None, lora: LoraSet | None = None,
                 cuda_graphs: bool = False, media_limits: MediaLimits | None = None,
                 kv_cache_dtype: str = "auto", kv_budget: KVBudget | None = None,
                 speculation: NgramSettings | None = None) -> None:
        """`kv_cache_dtype`: option.kv_cache_dtype's value (kv_dtype.py); `kv_budget`: what
        the running sequences' cache may take (kv_budget.py; None: no bound); `speculation`:
        option.speculative_config's n-gram proposals (loop/speculation.py)."""
        self.graphs = graphs
        self.kv_budget = kv_budget
        cache, why = kv_dtype.choose(kv_cache_dtype, loaded.model.dtype)
        self.kv_cache_dtype = kv_dtype.name(cache)  # the dtype chosen, as GET /config shows it
        super().__init__(
            loaded,
            lambda: ModelRunner(loaded.model, max_batch_size, loaded.max_model_len, graphs, lora,
                                cuda_graphs, cache),
            max_batch_size=max_batch_size, max_prefill_tokens=max_prefill_tokens,
            chat_template=chat_template, stall_timeout=stall_timeout,
            prefix_cache_bytes=prefix_cache_bytes,
            # Loaded or compiled once serving begins, not while the server starts: loading
            # holds the GIL for seconds.
            on_serve=graphs.start if graphs else None, on_stop=graphs.close if graphs else None,
            lora=lora, media=None if loaded.processor is None else MediaPrompts(loaded.processor),
            media_limits=media_limits, kv_budget=kv_budget, speculation=speculation)
        per_token = self.batcher.runner.kv_bytes_per_token
        log.info("KV cache: %s (%s), %d bytes per token", self.kv_cache_dtype, why, per_token)
        if kv_budget is not None:
            log.info("KV cache budget: %d tokens (%d bytes at %d bytes a token; the prefix "
                     "cache's %d bytes besides), from %s", self.batcher.admission.tokens,
                     kv_budget.bytes, per_token, prefix_cache_bytes, kv_budget.source)

    async def shutdown(self) -> None:
        await super().shutdown()
        memory.revoke(self.kv_budget and self.kv_budget.grant)  # its memory is free again

    def stats(self) -> dict[str, int]:
        stats = super().stats()
        if self.graphs is not None:
            stats.update(self.graphs.counts())
        if self.batcher.runner.cuda_graphs is not None:
            stats.update(self.batcher.runner.cuda_graphs.counts())
        return stats
