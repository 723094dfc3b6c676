"""option.kv_cache_dtype on the torch engine: the dtype its slot cache stores keys and values in,
and why (for the startup log).

`auto` is 16 bits: the model's own dtype where it computes in bf16 or float16 (its keys and values
are that already: nothing is lost), and float16 where it computes in float32 (a CPU without fast
bf16, say): float16 keeps 11 bits of a value's mantissa where bf16 keeps 8, over a range keys and
values stay well inside; half float32's memory, so a budget holds twice the tokens. `float32` keeps
the exact cache. `fp8`/`fp8_e4m3` and `fp8_e5m2` store float8 with a per-tensor scale of 1 (what
vLLM uses without calibrated scales): a value is clamped to the format's range and rounded once as
it is written, and read back exactly. Every conversion is one element's own, so a row's cache, and
its text, does not depend on the rest of its batch. On the CPU the attention kernel reads each of
these as it is stored (invariant_attention.cpp widens them to float32 as it reads); elsewhere the
cache's reads are converted to the model's dtype (kv_cache.py).
"""

from __future__ import annotations

import torch

# option.kv_cache_dtype's values (and the names `name` gives) -> the dtypes stored
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
          "fp8_e5m2": torch.float8_e5m2, "float8_e4m3fn": torch.float8_e4m3fn,
          "float8_e5m2": torch.float8_e5m2}
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def choose(option: str, model_dtype: torch.dtype) -> tuple[torch.dtype, str]:
    """The cache's dtype for option.kv_cache_dtype (already parsed: config/keys.py) over a model
    computing in `model_dtype`, and why."""
    if option != "auto":
        return DTYPES[option], "as option.kv_cache_dtype asks"
    if model_dtype in (torch.bfloat16, torch.float16):
        return model_dtype, (f"auto: the model computes in {name(model_dtype)}, so its keys and "
                             "values are that already")
    return torch.float16, (f"auto: 16 bits; the model computes in {name(model_dtype)}, and "
                           "float16 keeps more of a value than bfloat16 (11 bits against 8)")


def storable(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as the cache stores it: float8 clamped to its range first (a cast past it is not
    finite in every build), else converted."""
    if dtype in FLOAT8:
        limit = torch.finfo(dtype).max
        return x.clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
