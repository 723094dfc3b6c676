"""`option.quantize` for the torch engine: which linear layers run on quantized weights
(quant_linear.py), decided at load.

- `int4`: 4-bit groups. From a GGUF, its blocks as they are (4-bit ones stay 4-bit, 8-bit and
  6-bit ones run at 8 bits); from a float checkpoint, quantized at load (the LM head at 8 bits,
  as llama.cpp's 4-bit files keep theirs wider).
- `int8`: 8-bit groups: a float checkpoint quantized at load; a GGUF's blocks widened to 8 bits.
- `none`: float linears (a GGUF's blocks dequantized to float).
- `gguf`: a GGUF's quantized blocks as they are, its float tensors float (what `auto` picks for a
  GGUF where the kernel is faster; a float checkpoint has none).
- `auto` (the default): a GGUF's own blocks where the kernel beats float matmul on this CPU
  (a probe at startup, logged), its float tensors staying float; a float checkpoint keeps its
  float weights, except 16-bit ones on a CPU without fast bf16, which `int8` reads into 8-bit
  blocks rather than a float32 copy twice their size.

A float checkpoint's linears (and its token embedding, at 8 bits) are quantized as its files are
read (checkpoint_files.py), where llama_model.py builds it; others are quantized after loading.

A GGUF that gguf_model.py builds (llama, qwen2, qwen3, phi3) is served from its blocks without
coming here. On the dequantizing path, blocks are read from Llama-architecture GGUFs (llama.cpp's
converter reorders their q/k rows; gguf_blocks.py puts them back); `int8` and `int4` quantize
other GGUFs from their float values, `gguf` and `auto` leave them float.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from handlers.engine.registry import TORCH_QUANTIZE
from handlers.engine.torch import gguf_blocks, quant_linear
from handlers.engine.torch.dtype_probe import alternating_best, choose_cpu_dtype
from handlers.engine.torch.llama_model import is_llama
from handlers.engine.torch.quant_blocks import QuantizedWeight, from_float
from handlers.engine.torch.quant_linear import QuantLinear

MODES = TORCH_QUANTIZE
_PROBE = (1024, 1024)  # (out, in) of the probe's layer
_PROBE_ROWS = (1, 16)  # a one-stream step, and a batch
_REPEATS = 5
# The kernel and the float matmul timed in turn, this many times each: a one-row call takes
# ~20 us, and a start's other threads (the HTTP server starting, the embedding model's files
# located) once slowed all five of the kernel's samples in a row, so that a Zen 4 where it runs
# 5x bf16's speed chose bf16.
_ROUNDS = 5

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    mode: str  # none | int8 | int4 | gguf
    why: str  # for the log
    # The float dtype the probe measured this CPU serving in (None: no probe ran), so that
    # option.dtype=auto is not measured a second time.
    float_dtype: torch.dtype | None = None


def check_mode(value: str | None) -> str:
    """option.quantize, lower-cased (unset: auto); ValueError for a value the engine lacks."""
    mode = (value or "auto").lower()
    if mode not in MODES:
        raise ValueError(f"option.quantize {value!r}: the torch engine takes {', '.join(MODES)} "
                         "(AWQ, GPTQ, FP8 and bitsandbytes weights are vLLM's: "
                         "option.rolling_batch=vllm)")
    return mode


def plan(value: str | None, source: Path, device: torch.device, dtype: str = "auto") -> Plan:
    """What option.quantize=`value` does for `source` on `device` (`dtype`: option.dtype)."""
    mode = check_mode(value)
    if mode == "none":
        return Plan("none", "option.quantize=none")
    explicit = mode != "auto"
    why_not = _unavailable(device)
    if why_not is not None:
        if explicit:
            raise ValueError(f"option.quantize={mode}: {why_not}")
        return Plan("none", why_not)
    if explicit:
        return Plan(mode, f"option.quantize={mode}")
    if source.suffix.lower() != ".gguf":
        return _float_checkpoint(source, dtype)
    return _probe()


def _float_checkpoint(source: Path, dtype: str) -> Plan:
    """`auto` for a float checkpoint: its float weights, unless serving them would mean a
    float32 copy of 16-bit files (a CPU without fast bf16): then 8-bit blocks, quantized while
    the files are read, half the files' size instead of twice it."""
    if dtype.lower() != "auto":
        return Plan("none", f"a float checkpoint keeps its float weights at option.dtype={dtype}")
    stored = _checkpoint_dtype(source)
    chosen, why = choose_cpu_dtype()
    if stored in (torch.float16, torch.bfloat16) and chosen == torch.float32:
        name = str(stored).removeprefix("torch.")
        return Plan("int8", f"{name} weights would be copied to float32 (2x the files) on this "
                            f"CPU ({why}): quantized to 8 bits as they are read instead "
                            "(option.quantize=none keeps float32)", chosen)
    return Plan("none", "a float checkpoint keeps its float weights (option.quantize=int8 or "
                        "int4 quantizes them as they are read)", chosen)


def _checkpoint_dtype(source: Path) -> torch.dtype | None:
    """The dtype config.json says the weights are stored in."""
    try:
        config = json.loads((source / "config.json").read_text())
    except (OSError, ValueError):
        return None
    named = config.get("dtype") or config.get("torch_dtype")
    value = getattr(torch, named, None) if isinstance(named, str) else None
    return value if isinstance(value, torch.dtype) else None


def load_widths(mode: str) -> Callable[[str], int] | None:
    """The bits each linear layer of a float checkpoint is quantized to as it is read, by
    module name, under `mode` (None: float): the head at 8 bits, as llama.cpp's 4-bit files keep
    theirs wider."""
    if mode not in ("int8", "int4"):
        return None
    bits = 4 if mode == "int4" else 8
    return lambda name: 8 if name == "lm_head" else bits


def _unavailable(device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"quantized linears run on the CPU only (here {device})"
    if not quant_linear.available():
        return "the quantized-linear kernel could not be built here"
    return None


def _probe() -> Plan:
    """A GGUF's blocks where the kernel beats the float dtype this CPU would serve in, over a
    one-row and a 16-row matmul together (geometric mean)."""
    dtype, _ = choose_cpu_dtype()
    out, size = _PROBE
    weight = torch.randn(out, size) * 0.05
    quantized = QuantLinear(from_float(weight, 4))
    float_weight = weight.to(dtype)
    speedups = []
    for rows in _PROBE_ROWS:
        x = torch.randn(rows, size)
        x_float = x.to(dtype)
        seconds = alternating_best(
            {"kernel": lambda x=x: quantized(x),
             "float": lambda x=x_float: torch.nn.functional.linear(x, float_weight)},
            _ROUNDS, _REPEATS)
        speedups.append(seconds["float"] / seconds["kernel"])
    measured = ", ".join(f"{s:.1f}x at {r} row{'s' * (r > 1)}"
                         for s, r in zip(speedups, _PROBE_ROWS, strict=True))
    name = str(dtype).removeprefix("torch.")
    cpu = torch.backends.cpu.get_cpu_capability()
    if speedups[0] * speedups[1] >= 1:
        return Plan("gguf", f"the GGUF's blocks: the kernel runs {measured} {name}'s speed "
                            f"here ({cpu})", dtype)
    return Plan("none", f"dequantized to {name}: the kernel runs {measured} {name}'s speed "
                        f"here ({cpu})", dtype)


def quantize_model(model: nn.Module, mode: str, source: Path,
                   cache_dir: Path | None = None) -> str:
    """Replace `model`'s linear layers by quantized ones for `mode` (a `Plan`'s): from
    `source`'s blocks where it is a Llama GGUF, else quantized from the float weights (`gguf`:
    the blocks only). What the model's linears now are: none, int8 or int4 (the narrowest)."""
    bits = 4 if mode == "int4" else 8
    blocks: dict[str, QuantizedWeight] = {}
    if source.suffix.lower() == ".gguf" and is_llama(model):
        config = model.config
        blocks = gguf_blocks.cached_blocks(source, config.num_attention_heads,
                                           config.num_key_value_heads, cache_dir)
    for name, linear in [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]:
        if linear.bias is not None or not quant_linear.fits(linear.out_features,
                                                            linear.in_features):
            continue
        weight = blocks.get(name)
        if weight is None and mode == "gguf":
            continue
        if weight is None:
            weight = from_float(linear.weight, 8 if name == "lm_head" else bits)
        elif mode == "int8" and weight.bits == 4:
            weight = QuantizedWeight(weight.values, weight.scales, weight.mins, 8)
        model.set_submodule(name, QuantLinear(weight))
    return linear_widths(model)


def linear_widths(model: nn.Module) -> str:
    """What `model`'s linears are: none (float), int8 or int4 (the narrowest)."""
    widths = {module.bits for module in model.modules() if isinstance(module, QuantLinear)}
    return "none" if not widths else f"int{min(widths)}"
