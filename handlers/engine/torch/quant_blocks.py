"""A linear layer's weights in 4- or 8-bit groups of 32 inputs, as GGUF's blocks hold them:
w = d * u + m, with u an unsigned integer (0..15 or 0..255) and, per output and group, a scale d
and a min m (float16, as GGUF stores them).

GGUF's types map onto this as they are (gguf_blocks.py): Q4_0 (m = -8d), Q4_1, Q8_0 (u = q + 128,
m = -128d). A float checkpoint is quantized at load by `from_float`: 4 or 8 bits between each
group's min and max (Q4_1's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # inputs of a group
LEVELS = {4: 15, 8: 255}  # the largest u of each width


@dataclass(frozen=True)
class QuantizedWeight:
    values: torch.Tensor  # uint8 [out, in]: u
    scales: torch.Tensor  # float16 [out, in / GROUP]: d
    mins: torch.Tensor  # float16 [out, in / GROUP]: m
    bits: int  # 4 or 8

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] these blocks stand for."""
        out, size = self.values.shape
        u = self.values.view(out, size // GROUP, GROUP).float()
        w = self.scales.float()[..., None] * u + self.mins.float()[..., None]
        return w.reshape(out, size)

    def rows(self, order: torch.Tensor) -> QuantizedWeight:
        """The same blocks with their outputs reordered (`order` indexes the outputs)."""
        return QuantizedWeight(self.values[order], self.scales[order], self.mins[order],
                               self.bits)


def from_float(weight: torch.Tensor, bits: int) -> QuantizedWeight:
    """`weight` [out, in] quantized in groups of 32 between each group's min and max, as Q4_1
    (4 bits) and in 8 bits the same way (a step of (max - min) / 255, never coarser than Q8_0's
    symmetric max|w| / 127). The scale and min are rounded to float16 before the values are
    computed from them, so they agree with what the kernel multiplies."""
    if bits not in LEVELS:
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    out, size = weight.shape
    # One float copy, computed on in place: quantizing a checkpoint as it is read holds the
    # quantized model and this chunk's copy, not several temporaries of it.
    w = weight.detach().to(torch.float32, copy=True).reshape(out, size // GROUP, GROUP)
    low, high = w.amin(-1), w.amax(-1)
    scales, mins = ((high - low) / LEVELS[bits]).half(), low.half()
    d, m = scales.float()[..., None], mins.float()[..., None]
    u = w.sub_(m).div_(torch.where(d > 0, d, 1)).round_().mul_(d > 0)
    values = u.clamp_(0, LEVELS[bits]).to(torch.uint8).reshape(out, size)
    return QuantizedWeight(values, scales, mins, bits)


def joined(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Blocks of several layers reading one input, their outputs one after another (a fused
    projection's); 4-bit where every part is, else 8-bit (4-bit values fit as they are)."""
    bits = max(part.bits for part in parts)
    return QuantizedWeight(*(torch.cat([getattr(p, field) for p in parts])
                             for field in ("values", "scales", "mins")), bits)
