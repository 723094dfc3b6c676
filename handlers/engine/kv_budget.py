"""The KV cache's memory budget, fixed at startup once the weights are loaded: what the running
sequences' keys and values (and the prompts kept for reuse) may take in all. The batcher admits
requests within it (loop/admission.py).

Where it comes from, first that applies:
- `option.kv_cache_memory_bytes` (vLLM's `kv_cache_memory_bytes`; vLLM's CPU variable
  `VLLM_CPU_KVCACHE_SPACE`, in GiB, sets it too): that many bytes;
- `option.gpu_memory_utilization` when given (DJL's and vLLM's name; on the CPU, the share of
  the memory the process may use): that share of the memory (the cgroup's limit where there is
  one, else the machine's), less what the process holds once loaded;
- else the memory still available once loaded (memory.py: under the cgroup's limit, else the
  machine's MemAvailable), less a margin for the activations of the passes and the rest of the
  process: a tenth of it and HEADROOM_BYTES more.

Available memory leaves out the budgets granted to other engines of the process (memory.grant);
the engine revokes its own when it shuts down.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from handlers.config import Config, ConfigError
from handlers.engine.memory import CGROUP, Memory, grant, memory

log = logging.getLogger(__name__)

HEADROOM_BYTES = 256 << 20
MARGIN = 0.1  # of the available memory, kept from a budget computed from it
GIB = 1 << 30


@dataclass(frozen=True)
class KVBudget:
    bytes: int
    source: str  # the setting, or the measure, it comes from (errors and the log name it)
    grant: int | None = None  # memory.grant's key, revoked when the engine shuts down

    def granted(self) -> KVBudget:
        """This budget, its bytes set aside (memory.grant)."""
        return replace(self, grant=grant(self.bytes))


def kv_budget(config: Config, cgroup: Path = CGROUP, used: int | None = None) -> KVBudget:
    """The budget for `config`, measured now (after loading), and granted where a setting
    sized it: `cgroup` is where the container's cgroup is mounted, `used` what this process
    holds (its resident memory unless given). The default (most of what is available) is the
    engine's own bound, not set aside: granted, it left a multi-model endpoint's later models
    (`POST /models`) a tenth of the memory, then nothing."""
    budget = _budget(config, memory(cgroup), used)
    sized = config.kv_cache_memory_bytes is not None or _given(config, "gpu_memory_utilization")
    return budget.granted() if sized else budget


def _budget(config: Config, left: Memory, used: int | None) -> KVBudget:
    if config.kv_cache_memory_bytes is not None:
        given = _source(config, "kv_cache_memory_bytes")
        if _given(config, "gpu_memory_utilization"):
            raise ConfigError(f"option.kv_cache_memory_bytes ({given}) and "
                              "option.gpu_memory_utilization "
                              f"({_source(config, 'gpu_memory_utilization')}) both size the "
                              "KV cache: give one of them")
        if config.kv_cache_memory_bytes > left.available:  # memory may be freed: not refused
            log.warning("option.kv_cache_memory_bytes=%d is more than the %s GiB available now: "
                        "a full cache may not fit", config.kv_cache_memory_bytes,
                        _gib(left.available))
        return KVBudget(config.kv_cache_memory_bytes,
                        f"option.kv_cache_memory_bytes={config.kv_cache_memory_bytes}, {given}")
    used = psutil.Process().memory_info().rss if used is None else used
    if _given(config, "gpu_memory_utilization"):
        return _share(config.gpu_memory_utilization, left, used,
                      _source(config, "gpu_memory_utilization"))
    budget = int(left.available * (1 - MARGIN)) - HEADROOM_BYTES
    source = (f"{_gib(left.available)} GiB available once loaded, less {MARGIN:.0%} and "
              f"{HEADROOM_BYTES >> 20} MiB; option.kv_cache_memory_bytes or "
              "option.gpu_memory_utilization sets it")
    if budget <= 0:
        raise ConfigError(f"no memory is left for the KV cache once the model is loaded "
                          f"({source})")
    return KVBudget(budget, source)


def _share(fraction: float, left: Memory, used: int, given: str) -> KVBudget:
    """option.gpu_memory_utilization's budget: `fraction` of the memory, less `used`."""
    budget = int(fraction * left.total) - used
    source = (f"option.gpu_memory_utilization={fraction:g} ({given}) of {_gib(left.total)} "
              f"GiB, less the {_gib(used)} GiB the process holds once loaded")
    if budget <= 0:
        raise ConfigError(f"no memory is left for the KV cache: {source}")
    if budget > left.available:
        raise ConfigError(f"the KV cache's budget, {_gib(budget)} GiB ({source}), is more "
                          f"than the {_gib(left.available)} GiB available: lower "
                          "option.gpu_memory_utilization")
    return KVBudget(budget, source)


def _given(config: Config, field: str) -> bool:
    return config.sources.get(field, "default") != "default"


def _source(config: Config, field: str) -> str:
    return config.sources.get(field, "default")


def _gib(size: int) -> str:
    return f"{size / GIB:.2f}"
