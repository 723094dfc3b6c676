"""float32 and bfloat16 linear layers through oneDNN with prepacked weights, on the CPU.

torch's `nn.Linear` on the CPU calls MKL's sgemm. oneDNN (bundled with torch, and what
inductor's CPU freezing pass uses) was much faster on the AMD EPYC measured, more so with the
weight reordered once into its blocked layout instead of repacked on every call: SmolLM2's 211
linear layers (one decode step, 2 cores) took 60 → 39 ms at 1 row, 110 → 60 ms at 32 and
527 → 423 ms at 256 (`bench/linear_kernels.py`). The results are float32 too; only the
summation order differs (relative error ~1e-6).

The ops are torch's private `torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`:
`use_onednn_linears` checks them against `nn.Linear` on a small matrix first, in the model's
dtype, and leaves the model as it is when they are missing or disagree (bf16 needs a CPU with
AVX-512 or AVX-NE-CONVERT).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

log = logging.getLogger(__name__)

# The batch size the weights' layout is tuned for: one pack serves every size (decode rows and
# prefill chunks); 32 measured best across 1..256 rows.
PACK_FOR_ROWS = 32


class OneDnnLinear(nn.Module):
    """`nn.Linear`'s forward over a oneDNN-packed copy of its weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias,
                                                  "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def use_onednn_linears(model: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Swap every `nn.Linear` of a CPU model in `dtype` (float32 or bfloat16) for
    `OneDnnLinear`; the number swapped (0 where oneDNN cannot serve them)."""
    if not _usable(dtype):
        return 0
    # A head tied to the token embedding is packed too, though the table is then held twice
    # (the embedding looks rows up in it): MKL's nn.Linear computes one row (GEMV) and several
    # (GEMM) in different orders, and a row's logits would depend on its batch.
    targets = [(parent, name) for parent in model.modules()
               for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.dtype == dtype
               and child.weight.device.type == "cpu"]
    # Reordering runs outside the GIL: one thread per core halves a second of startup. A few
    # at a time, each swapped in as it is packed, so that a start holds the float weights once
    # and a few layers twice, not the whole model twice.
    threads = os.cpu_count() or 1
    with ThreadPoolExecutor(threads) as pool:
        for first in range(0, len(targets), threads):
            batch = targets[first:first + threads]
            packed = pool.map(OneDnnLinear, (getattr(parent, name) for parent, name in batch))
            for (parent, name), linear in zip(batch, packed, strict=True):
                setattr(parent, name, linear)
    return len(targets)


def _usable(dtype: torch.dtype) -> bool:
    """Whether the private ops exist and agree with `nn.Linear` here, in `dtype`."""
    if not torch.backends.mkldnn.is_available():
        return False
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else \
        {"rtol": 2e-2, "atol": 2e-2}
    try:
        linear = nn.Linear(64, 48).to(dtype)
        x = torch.randn(3, 5, 64, dtype=dtype)
        with torch.inference_mode():
            agree = torch.allclose(OneDnnLinear(linear)(x), linear(x), **tolerance)
    except (RuntimeError, AttributeError) as exc:
        log.info("oneDNN linears unavailable (%s); using nn.Linear", exc)
        return False
    if not agree:
        log.warning("oneDNN linears disagree with nn.Linear here; using nn.Linear")
    return agree
