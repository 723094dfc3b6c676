"""Whether vLLM can place the workers a configuration asks for, checked before vLLM starts them.

vLLM splits a model across `tensor_parallel_size x pipeline_parallel_size` workers, each a
process. A degree the model cannot take (attention heads that do not divide, fewer layers than
stages) fails deep inside vLLM with a pydantic traceback or a worker's assertion, so it is
refused here naming the setting. vLLM's CPU build pins each worker's OpenMP threads to CPUs of its
own and, left to itself, asks for one NUMA node per worker: on a one-node machine it stops with
"Not enough allowed NUMA nodes". The server sets that pinning (VLLM_CPU_OMP_THREADS_BIND, vLLM's
format: one CPU list per worker, joined by '|') from the CPUs this process may use, unless the
user set it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from handlers.config import Config, ConfigError

log = logging.getLogger(__name__)

THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"


@dataclass(frozen=True)
class Shape:
    """What the split depends on, from the model's (text) config."""

    attention_heads: int
    kv_heads: int
    layers: int


def model_shape(model_dir: Path, trust_remote_code: bool = False) -> Shape | None:
    """The model's heads and layers; None where its config does not say (vLLM then decides)."""
    from transformers import AutoConfig

    try:
        text = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    text = text.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(heads, int) or not isinstance(layers, int):
        return None
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return Shape(heads, kv_heads, layers)


def check_split(config: Config, kwargs: dict, shape: Shape | None) -> None:
    """ConfigError naming the setting when the model cannot be split as asked."""
    if shape is None:
        return
    tp = int(kwargs.get("tensor_parallel_size", 1))
    pp = int(kwargs.get("pipeline_parallel_size", 1))
    if tp > 1 and shape.attention_heads % tp:
        raise ConfigError(
            f"{_given(config, 'tensor_parallel')}: the model's {shape.attention_heads} "
            f"attention heads do not split evenly into {tp} tensor-parallel workers; choose a "
            "degree that divides them")
    if tp > 1 and shape.kv_heads % tp and tp % shape.kv_heads:
        raise ConfigError(
            f"{_given(config, 'tensor_parallel')}: the model's {shape.kv_heads} key-value heads "
            f"neither split evenly into {tp} workers nor divide {tp} (vLLM replicates them only "
            "then)")
    if pp > shape.layers:
        raise ConfigError(
            f"{_given(config, 'pipeline_parallel')}: {pp} pipeline stages for the model's "
            f"{shape.layers} layers; at most one stage per layer")


def check_cpu_pipeline(config: Config, kwargs: dict) -> None:
    """vLLM 0.32's CPU runner makes the buffers a later pipeline stage receives into only while
    warming up its compiled model, which eager mode skips: the second stage's first step then
    fails its assertion and kills the engine. Refused here instead, naming both settings."""
    if int(kwargs.get("pipeline_parallel_size", 1)) > 1 and kwargs.get("enforce_eager"):
        raise ConfigError(
            f"{_given(config, 'pipeline_parallel')} with option.enforce_eager=true "
            f"({config.sources['enforce_eager']}): vLLM's CPU build runs pipeline stages only "
            "with its compiled model (eager mode never makes the buffers a later stage receives "
            "into); set option.enforce_eager=false")


def bind_cpu_workers(config: Config, kwargs: dict, cpus: Sequence[int],
                     environ: MutableMapping[str, str] = os.environ) -> None:
    """On vLLM's CPU build: each of the DP x TP x PP workers (vLLM's rank order) gets an equal
    share of `cpus` (the CPUs this process may use), unless VLLM_CPU_OMP_THREADS_BIND is set;
    more workers than CPUs is refused naming the settings."""
    tp = int(kwargs.get("tensor_parallel_size", 1))
    pp = int(kwargs.get("pipeline_parallel_size", 1))
    # Across option.nnodes machines (vLLM's multi-node), this one runs its share of the ranks.
    workers = tp * pp * int(kwargs.get("data_parallel_size", 1)) // int(kwargs.get("nnodes", 1))
    if workers == 1:
        return
    if kwargs.get("distributed_executor_backend") == "ray":
        return  # each Ray node binds its own workers' threads: these CPUs are this node's only
    if environ.get(THREADS_BIND):
        log.info("vLLM's CPU workers: %s=%s, as given", THREADS_BIND, environ[THREADS_BIND])
        return
    if workers > len(cpus):
        raise ConfigError(
            f"{_given(config, 'tensor_parallel')} x {_given(config, 'pipeline_parallel')}: "
            f"{workers} vLLM CPU workers need a CPU each, and this process may use "
            f"{len(cpus)} ({_ranges(sorted(cpus))}); lower a degree or give the container more "
            "CPUs")
    environ[THREADS_BIND] = "|".join(_ranges(share) for share in shares(sorted(cpus), workers))
    log.info("vLLM's CPU workers: %d (tensor %d x pipeline %d x data %d), threads bound %s=%s",
             workers, tp, pp, workers // (tp * pp), THREADS_BIND, environ[THREADS_BIND])


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity: a container's cpuset, taskset)."""
    return sorted(os.sched_getaffinity(0))


def shares(cpus: Sequence[int], workers: int) -> list[list[int]]:
    """`cpus` cut into `workers` consecutive runs, the first ones a CPU longer where they do not
    divide."""
    size, extra = divmod(len(cpus), workers)
    runs, start = [], 0
    for worker in range(workers):
        end = start + size + (worker < extra)
        runs.append(list(cpus[start:end]))
        start = end
    return runs


def _ranges(cpus: Sequence[int]) -> str:
    """`[0, 1, 2, 5]` as "0-2,5", the CPU list form vLLM (and taskset) read."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def _given(config: Config, name: str) -> str:
    field = f"{name}_degree"
    return f"option.{field}={getattr(config, field)} ({config.sources[field]})"
