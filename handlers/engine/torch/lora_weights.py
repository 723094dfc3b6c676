"""A PEFT LoRA adapter's weights, read as PEFT saves them and checked against the base model.

PEFT writes `adapter_config.json` and `adapter_model.safetensors` (or `.bin`) whose keys are
`base_model.model.<module>.lora_A.weight` ([r, in]) and `….lora_B.weight` ([out, r]); the update
to `<module>`'s output is `scaling · B (A x)`, scaling `lora_alpha / r` (`lora_alpha / √r` with
`use_rslora`), per module where `rank_pattern` / `alpha_pattern` say so. What PEFT can save but
an unmerged low-rank update cannot express here (DoRA, trained biases, replaced modules, LoRA on
embeddings) is refused, naming it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from handlers.engine.types import AdapterError

CONFIG_FILE = "adapter_config.json"
_PREFIX = "base_model.model."
_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<half>[AB])(?:\.[^.]+)?\.weight")


@dataclass(frozen=True)
class ModuleUpdate:
    down: torch.Tensor  # A: [rank, in]
    up: torch.Tensor  # scaling · B: [out, rank]

    @property
    def rank(self) -> int:
        return self.down.shape[0]


@dataclass(frozen=True)
class AdapterWeights:
    name: str
    path: Path
    modules: dict[str, ModuleUpdate]  # the base model's module name -> its update

    @property
    def rank(self) -> int:
        return max(update.rank for update in self.modules.values())


# (module name) -> (in_features, out_features) where the engine applies LoRA, else None
Shapes = Callable[[str], tuple[int, int] | None]


def read_adapter(name: str, path: Path, shapes: Shapes, max_rank: int,
                 dtype: torch.dtype) -> AdapterWeights:
    """`path`'s adapter, its updates in `dtype`; AdapterError naming what does not fit."""
    config = _config(path)
    tensors = _tensors(path)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key.removeprefix(_PREFIX))
        if match is None:
            raise AdapterError(f"its weight {key!r} is no LoRA A/B matrix (LoRA on embeddings "
                               "or a trained bias are not served)")
        halves.setdefault(match["module"], {})[match["half"]] = tensor
    if not halves:
        raise AdapterError("its weights hold no LoRA matrices")
    modules = {module: _update(module, pair, config, shapes, max_rank, dtype)
               for module, pair in halves.items()}
    return AdapterWeights(name, path, modules)


def _config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeError, ValueError) as exc:
        raise AdapterError(f"cannot read its {CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{CONFIG_FILE} describes no LoRA adapter")
    unsupported = {
        "DoRA (use_dora)": config.get("use_dora"),
        f"trained biases (bias={config.get('bias')!r})": config.get("bias", "none") != "none",
        f"replaced modules (modules_to_save={config.get('modules_to_save')})":
            config.get("modules_to_save"),
    }
    for what, present in unsupported.items():
        if present:
            raise AdapterError(f"it uses {what}, which unmerged LoRA serving does not apply")
    return config


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    safetensors, pickled = path / "adapter_model.safetensors", path / "adapter_model.bin"
    try:
        if safetensors.is_file():
            from safetensors.torch import load_file

            return load_file(safetensors)
        if pickled.is_file():
            return torch.load(pickled, map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged file: whatever the reader raises names it
        raise AdapterError(f"cannot read its weights: {exc}") from None
    raise AdapterError("holds no adapter_model.safetensors or adapter_model.bin")


def _update(module: str, pair: Mapping[str, torch.Tensor], config: dict[str, Any],
            shapes: Shapes, max_rank: int, dtype: torch.dtype) -> ModuleUpdate:
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"module {module!r} has lora_{next(iter(pair))} without its partner")
    down, up = pair["A"], pair["B"]
    shape = shapes(module)
    if shape is None:
        raise AdapterError(f"it targets {module!r}, which is not a projection of this model "
                           "that LoRA applies to (q/k/v/o_proj, gate/up/down_proj)")
    rank = down.shape[0]
    if down.dim() != 2 or up.dim() != 2 or up.shape[1] != rank or \
            (down.shape[1], up.shape[0]) != shape:
        raise AdapterError(f"module {module!r}: A {tuple(down.shape)} and B {tuple(up.shape)} "
                           f"do not fit the base model's {shape[0]} -> {shape[1]} projection")
    if rank > max_rank:
        raise AdapterError(f"module {module!r} has rank {rank}, above option.max_lora_rank="
                           f"{max_rank}")
    alpha = _pattern(config.get("alpha_pattern"), module, config.get("lora_alpha", 8))
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return ModuleUpdate(down.to(dtype).contiguous(), (up.float() * scaling).to(dtype))


def _pattern(patterns: Mapping[str, Any] | None, module: str, default: Any) -> float:
    """PEFT's per-module override: the first pattern whose regex ends `module`'s name."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(value)
    return float(default)
