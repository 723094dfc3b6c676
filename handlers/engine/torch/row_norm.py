"""RMSNorm as an op opaque to inductor (row_norm.cpp: torch's own kernel behind it): the final
norm of the CPU decode step over quantized linears (the layers' norms run inside the quantized
linears' own op, QuantLinear.forward, for the same reason).

An eager pass runs torch's rms_norm; a compiled step would run inductor's own reduction, summing
a row's squares in another order: float32 results ~1e-7 apart, which float linears carry along,
but which the quantized linears' int8 rounding of their inputs turns into different logits (up
to 0.66 apart for SmolLM2's blocks). A request decoded eagerly (before the graphs load, or beside
a LoRA row) could then answer differently from the same request in a compiled step. Behind this
op both run torch's kernel, so both give the eager pass's bits.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from handlers.engine import native_build

SOURCE = Path(__file__).with_name("row_norm.cpp")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's `rms_norm(x, weight.shape, weight, eps)`, opaque to inductor."""
    return torch.ops.lmi_rows.rms_norm(x, weight, eps)


@functools.cache
def available() -> bool:
    """Whether the op is loaded (built on first use, once per process)."""
    return native_build.load(SOURCE, "RMSNorm runs on torch's op, whose bits a compiled step "
                             "does not reproduce", {"lmi_rows::rms_norm": _shape})


def _shape(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What torch.export traces the op as: `x`'s shape and dtype."""
    return torch.empty_like(x)
