"""Projections that read the same input run as one matmul: an attention's q/k/v and an MLP's
gate/up (the Llama-style names most decoder models share). One decode step of SmolLM2 then makes
60 matmul calls fewer; at a few rows a step is dominated by per-call overhead, not arithmetic.

The model's own forward code stays as it is: each projection becomes a `ProjectionPart` that
returns its slice of the fused output, computed when the first part sees a new input tensor (the
parent passes the same tensor object to each) and dropped once every part took its slice.
"""

from __future__ import annotations

import torch
from torch import nn

from handlers.engine.torch.quant_linear import QuantLinear

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedProjection(nn.Module):
    def __init__(self, linears: list[nn.Linear] | list[QuantLinear]) -> None:
        fused = QuantLinear.fused(linears) if isinstance(linears[0], QuantLinear) \
            else _fused_linear(linears)
        self._hold(fused, [linear.out_features for linear in linears])

    @classmethod
    def over(cls, fused: nn.Module, sizes: list[int]) -> SharedProjection:
        """One over a layer fused already (outputs of `sizes`, one after another)."""
        shared = cls.__new__(cls)
        shared._hold(fused, sizes)
        return shared

    def _hold(self, fused: nn.Module, sizes: list[int]) -> None:
        nn.Module.__init__(self)
        self.sizes = sizes
        self.fused = fused
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._taken = 0

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input:
            self._outputs = self.fused(x).split(self.sizes, dim=-1)
            self._input, self._taken = x, 0
        out = self._outputs[index]
        self._taken += 1
        if self._taken == len(self.sizes):  # hold no activations between passes
            self._input, self._outputs = None, ()
        return out


class ProjectionPart(nn.Module):
    def __init__(self, shared: SharedProjection, index: int) -> None:
        super().__init__()
        self.shared = shared
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.output(self.index, x)


def _fused_linear(linears: list[nn.Linear]) -> nn.Linear:
    first = linears[0]
    # On the meta device: a random init of the fused weights would take ~0.6 s of a start.
    fused = nn.Linear(first.in_features, sum(linear.out_features for linear in linears),
                      bias=first.bias is not None, dtype=first.weight.dtype, device="meta")
    with torch.no_grad():
        fused.weight = _joined([linear.weight for linear in linears])
        if first.bias is not None:
            fused.bias = _joined([linear.bias for linear in linears])
    return fused


def _joined(parts: list[torch.Tensor]) -> nn.Parameter:
    return nn.Parameter(torch.cat(parts))


def fuse_projections(model: nn.Module) -> int:
    """Fuse every q/k/v and gate/up group of plain `nn.Linear`s with one input size, dtype and
    bias setting, or of quantized ones (quant_linear.py) with one input size; the number of
    groups fused."""
    fused = 0
    # The parents only: a list of every module would keep each replaced projection's weights
    # alive until the end, holding the model's projections twice at the peak of a start.
    parents = [module for module in model.modules()
               if any(hasattr(module, names[0]) for names in GROUPS)]
    for module in parents:
        for names in GROUPS:
            linears = [getattr(module, name, None) for name in names]
            if _fusable(linears):
                share(module, names, SharedProjection(linears))
                fused += 1
    return fused


def share(module: nn.Module, names: tuple[str, ...], shared: SharedProjection) -> None:
    """`module`'s projections `names` become the parts of `shared`, in that order."""
    for index, name in enumerate(names):
        setattr(module, name, ProjectionPart(shared, index))


def _fusable(linears: list[object]) -> bool:
    first = linears[0]
    if all(type(linear) is QuantLinear for linear in linears):
        return all(linear.in_features == first.in_features for linear in linears)
    if not all(type(linear) is nn.Linear for linear in linears):
        return False
    return all(linear.in_features == first.in_features
               and linear.weight.dtype == first.weight.dtype
               and linear.weight.device == first.weight.device
               and (linear.bias is None) == (first.bias is None) for linear in linears)
