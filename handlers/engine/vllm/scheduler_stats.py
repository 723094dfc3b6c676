"""What vLLM's scheduler knows of its KV cache, read through vLLM's own extension point for
metrics: a stat logger (`AsyncLLM.from_engine_args(stat_loggers=...)`, the interface vLLM
documents for API users) that keeps the last reading, for /metrics' `vllm:kv_cache_usage_perc`
and `vllm:cache_config_info` as vLLM's own server reports them."""

from __future__ import annotations

from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase


class SchedulerReadings:
    """The latest scheduler reading, and the KV cache's shape once the engine sized it."""

    def __init__(self) -> None:
        self.kv_cache_usage = 0.0  # the share of KV-cache blocks in use, 0 to 1
        self.block_size = 0
        self.num_blocks = 0

    def factory(self, vllm_config: Any, engine_index: int = 0) -> StatLoggerBase:
        """A StatLoggerFactory: vLLM calls it once per engine core."""
        return _Logger(self, vllm_config)

    def stats(self) -> dict[str, float]:
        if not self.num_blocks:  # the engine has not sized its cache yet
            return {}
        return {"kv_cache_usage": self.kv_cache_usage, "kv_cache_block_size": self.block_size,
                "kv_cache_blocks": self.num_blocks}


class _Logger(StatLoggerBase):
    def __init__(self, readings: SchedulerReadings, vllm_config: Any) -> None:
        self.readings = readings
        self.cache_config = vllm_config.cache_config

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.readings.kv_cache_usage = scheduler_stats.kv_cache_usage

    def log_engine_initialized(self) -> None:
        """The cache is sized (num_gpu_blocks known) once the engine has initialized."""
        self.readings.block_size = self.cache_config.block_size
        self.readings.num_blocks = self.cache_config.num_gpu_blocks or 0
