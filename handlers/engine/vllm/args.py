"""lmi-serve's configuration -> vLLM's AsyncEngineArgs keyword arguments, as DJL LMI maps them.

LMI's own keys become the vLLM fields they stand for (`option.max_rolling_batch_size` ->
`max_num_seqs`, `option.tensor_parallel_degree` -> `tensor_parallel_size`, ...); any other
AsyncEngineArgs field may be given by name (`option.<field>`, or AWS's `SM_VLLM_<FIELD>`),
its text read as the field's type. A name that is no field, or a field given both ways, stops
startup. LoRA adapters to serve turn vLLM's LoRA on, sized for them (`lora_kwargs`). Imports
no vLLM: `fields` (name -> annotation) comes from the caller (`vllm_fields`).
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from collections.abc import Mapping
from typing import Any

from handlers.config import SETTINGS, Config, ConfigError, values

# LMI setting (Config field) -> the AsyncEngineArgs field it sets.
LMI_TO_VLLM = {
    "max_rolling_batch_size": "max_num_seqs",
    "max_rolling_batch_prefill_tokens": "max_num_batched_tokens",
    "enable_chunked_prefill": "enable_chunked_prefill",
    "max_model_len": "max_model_len",
    "dtype": "dtype",
    "kv_cache_dtype": "kv_cache_dtype",
    "trust_remote_code": "trust_remote_code",
    "tensor_parallel_degree": "tensor_parallel_size",
    "pipeline_parallel_degree": "pipeline_parallel_size",
    "quantize": "quantization",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "kv_cache_memory_bytes": "kv_cache_memory_bytes",
    "enforce_eager": "enforce_eager",
    "enable_prefix_caching": "enable_prefix_caching",
    "disable_sliding_window": "disable_sliding_window",
    "cpu_offload_gb_per_gpu": "cpu_offload_gb",
    "load_format": "load_format",
    "revision": "revision",
    # vLLM's structured outputs then constrain the answer after the thinking, as ours do
    "reasoning_parser": "reasoning_parser",
    # How many media a prompt may carry: vLLM sizes its encoder cache and memory profile by it
    # (the server reads and checks the media itself: engine/media/).
    "limit_mm_per_prompt": "limit_mm_per_prompt",
    # Speculative decoding, as vLLM takes it (the older DJL names were mapped onto it).
    "speculative_config": "speculative_config",
}
_DTYPES = {"auto": "auto", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_BY_FIELD = {s.field: s for s in SETTINGS}
# Fields lmi-serve sets from its own keys only.
_OWN = {"model": "option.model_id", "served_model_name": "option.model_name"}
# vLLM's CPU build reserves this share of the machine's memory for its KV cache unless told:
# 0.9 of a shared 2-core test machine fails to start, so the CPU gets a fixed cache instead.
CPU_KV_CACHE_BYTES = 4 << 30
# The max_lora_rank values vLLM accepts, where its field's annotation does not list them.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_fields() -> dict[str, Any]:
    """AsyncEngineArgs' fields: name -> annotation."""
    import dataclasses

    from vllm import AsyncEngineArgs

    return {f.name: f.type for f in dataclasses.fields(AsyncEngineArgs)}


def engine_kwargs(config: Config, model: str, fields: Mapping[str, Any], gpus: int) -> dict:
    """AsyncEngineArgs(**this) for `config`, serving `model` (a local directory) on `gpus`
    visible GPUs (0: vLLM's CPU build)."""
    kwargs: dict[str, Any] = {"model": model, "served_model_name": config.model_name,
                              "max_num_seqs": config.max_rolling_batch_size,
                              "dtype": _DTYPES[config.dtype],
                              # Our requests carry a priority (lower first, as vLLM's).
                              "scheduling_policy": "priority"}
    for field, target in LMI_TO_VLLM.items():
        if field in ("dtype", "max_rolling_batch_size") or not _given(config, field):
            continue
        kwargs[target] = getattr(config, field)
    if config.tensor_parallel_degree == "max":
        kwargs["tensor_parallel_size"] = max(gpus, 1)
    if "kv_cache_dtype" in kwargs:
        _check_kv_cache_dtype(config, fields)
    passed = by_name(config, fields)
    if gpus == 0 and not {"gpu_memory_utilization", "kv_cache_memory_bytes"} & {
            *passed, *(t for f, t in LMI_TO_VLLM.items() if _given(config, f))}:
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    return kwargs | lora_kwargs(config, fields) | passed


def _check_kv_cache_dtype(config: Config, fields: Mapping[str, Any]) -> None:
    """option.kv_cache_dtype must be one of the installed vLLM's cache dtypes (its field's
    Literal lists them; the registry let only vLLM's names through already)."""
    accepted = [a for a in typing.get_args(fields.get("kv_cache_dtype")) if isinstance(a, str)]
    if accepted and config.kv_cache_dtype not in accepted:
        raise ConfigError(f"option.kv_cache_dtype={config.kv_cache_dtype} "
                          f"({config.sources['kv_cache_dtype']}) is not a KV cache dtype of this "
                          f"vLLM, which takes {', '.join(accepted)}")


def lora_kwargs(config: Config, fields: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's LoRA arguments (config.lora): on, max_loras slots, and max_lora_rank as given,
    else the smallest rank vLLM accepts that holds the largest adapter's."""
    limits = config.lora
    if limits is None:
        return {}
    rank = limits.max_rank if limits.rank_given else lora_rank(limits.max_rank, fields)
    return {"enable_lora": True, "max_loras": limits.max_loras, "max_lora_rank": rank}


def lora_rank(rank: int, fields: Mapping[str, Any]) -> int:
    """The smallest max_lora_rank vLLM accepts that holds `rank`."""
    accepted = typing.get_args(fields.get("max_lora_rank")) or LORA_RANKS
    fits = [r for r in accepted if isinstance(r, int) and r >= rank]
    if not fits:
        raise ConfigError(f"LoRA rank {rank} is above the largest vLLM serves, "
                          f"{max(accepted)}")
    return min(fits)


def by_name(config: Config, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The AsyncEngineArgs fields given by name, typed; ConfigError for an unknown name or one
    that an LMI key given too already sets."""
    taken = {target: f"option.{field}" for field, target in LMI_TO_VLLM.items()
             if _given(config, field)}
    passed: dict[str, Any] = {}
    for name, (text, source) in config.engine_args.items():
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f"; did you mean option.{close[0]}?" if close else ""
            raise ConfigError(f"option.{name}={text} ({source}): vLLM's engine has no argument "
                              f"{name!r}{hint}")
        if name in _OWN:
            raise ConfigError(f"option.{name} ({source}): set {_OWN[name]} instead")
        if name in taken:
            raise ConfigError(f"option.{name}={text} ({source}) and {taken[name]} "
                              f"({config.sources[_field_of(taken[name])]}) both set vLLM's "
                              f"{name}: give one of them")
        passed[name] = typed(name, text, source, fields[name])
    return passed


def typed(name: str, text: str, source: str, annotation: Any) -> Any:
    """`text` as a value of the field's type: text for a text field, a boolean for a flag, else
    JSON (numbers, lists, objects), else the text itself (a Literal's choice)."""
    kinds = _kinds(annotation)
    if kinds <= {str, type(None)} and str in kinds:
        return text
    if bool in kinds:
        try:
            return values.boolean(text)
        except ValueError:
            if kinds == {bool}:
                raise ConfigError(f"option.{name}={text!r} ({source}): expected true or false"
                                  ) from None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _kinds(annotation: Any) -> set[Any]:
    """The plain types a (possibly Optional / union / Literal) annotation admits."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_kinds(arg) for arg in typing.get_args(annotation)))
    if origin is typing.Literal:
        return {type(arg) for arg in typing.get_args(annotation)}
    return {origin or annotation}


def _given(config: Config, field: str) -> bool:
    """Whether the LMI setting asks for other than its default (`max` parallelism is the
    GPU count, set separately; option.quantize=none is vLLM's own default, no quantization)."""
    return config.is_set(_BY_FIELD[field]) and not (
        field == "tensor_parallel_degree" and config.tensor_parallel_degree == "max") and not (
        field == "quantize" and str(config.quantize).lower() == "none")


def _field_of(key: str) -> str:
    return next(s.field for s in SETTINGS if s.key == key)
