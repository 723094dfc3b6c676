"""Linear layers over 4- and 8-bit weights on the CPU (`option.quantize`), computed as llama.cpp
computes its quantized dot products.

A one-row decode step is bound by reading the weights: float32 reads 32 bits a weight, GGUF's
Q4_1 blocks 5. And int8 dot products run at several times float32's rate where the CPU has
VNNI (AVX-512 or AVX-VNNI). `lmi_quant::quant_linear` (quant_linear.cpp) reads the weights in
their blocks and quantizes each input row to int8 in groups of 32, sums each group's products
in int32 and adds the groups' scaled sums in float32, in one order.

Why the inputs are quantized at every batch size, not only where it is compute-bound: integer
sums are exact, so every unit gives the same sums, and a row's output never depends on the
rows beside it or on which kernel a batch's size chose. A weight-only kernel at one row and an
int8 GEMM at 32 would give a request alone and the same request in a batch different logits.

The kernel is built like invariant_attention's, on first use, for this CPU: AVX-512 VNNI (with
AMX's tile multiplies for whole blocks of 16 rows where the CPU has AMX-INT8), else AVX2
(vpmaddubsw), else plain C++, each giving the same bits.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from handlers.engine import native_build
from handlers.engine.torch.quant_blocks import GROUP, QuantizedWeight, joined

SOURCE = Path(__file__).with_name("quant_linear.cpp")
TILE = 16  # outputs of a tile (the kernel's layout)
CHUNK = 4  # inputs of a chunk: one int32 lane of a vector


class QuantLinear(nn.Module):
    """`nn.Linear`'s forward over `QuantizedWeight` blocks, packed for the kernel; a bias (a
    GGUF's float one: Qwen2's q/k/v) is added to the kernel's outputs, in their dtype."""

    def __init__(self, blocks: QuantizedWeight) -> None:
        super().__init__()
        self._hold(*pack(blocks), blocks.bits)

    @classmethod
    def packed(cls, weights: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
               bits: int, bias: torch.Tensor | None = None) -> QuantLinear:
        """A layer over buffers in the kernel's layout already."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._hold(weights, scales, mins, bits, bias)
        return layer

    def _hold(self, weights: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
              bits: int, bias: torch.Tensor | None = None) -> None:
        tiles, groups, _ = weights.shape
        self.out_features, self.in_features = tiles * TILE, groups * GROUP
        self.bits = bits
        self.weights = nn.Buffer(weights)
        self.scales = nn.Buffer(scales)
        self.mins = nn.Buffer(mins)
        self.register_buffer("bias", bias)  # None: no bias

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """`x`'s outputs; with `norm` (an RMSNorm), those of `norm(x)`, the norm computed in
        the op (as `rms_norm` computes it): a compiled step, where inductor would generate the
        norm itself and sum a row's squares in another order, then gives the eager pass's bits,
        which the int8 rounding of the inputs would otherwise turn into different logits."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            return self(x.float(), norm).to(x.dtype)
        weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.variance_epsilon)
        out = torch.ops.lmi_quant.quant_linear(x, self.weights, self.scales, self.mins,
                                               self.bits, weight, eps)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"int{self.bits} groups of {GROUP}, bias={self.bias is not None}"

    @staticmethod
    def fused(parts: list[QuantLinear]) -> QuantLinear:
        """One layer computing `parts`' outputs one after another (they read one input): the
        packed buffers joined tile after tile as they are, where every part has the same width
        (4-bit parts beside 8-bit ones join as 8-bit values, repacked); their biases joined
        where any has one (zeros for a part without)."""
        biases = [part.bias for part in parts if part.bias is not None]
        bias = None if not biases else torch.cat([
            biases[0].new_zeros(part.out_features) if part.bias is None else part.bias
            for part in parts])
        if len({part.bits for part in parts}) > 1:
            layer = QuantLinear(joined([part.unpacked() for part in parts]))
            return QuantLinear.packed(layer.weights, layer.scales, layer.mins, layer.bits, bias)
        return QuantLinear.packed(*(torch.cat([getattr(part, name) for part in parts])
                                    for name in ("weights", "scales", "mins")), parts[0].bits,
                                  bias)

    def unpacked(self) -> QuantizedWeight:
        """The blocks this layer was packed from."""
        return unpack(self.weights, self.scales, self.mins, self.bits)


class QuantEmbedding(nn.Module):
    """A token embedding over packed blocks (`QuantLinear`'s layout, a tied head's own buffers):
    each token's row dequantized when it is looked up, d * u + m in float32 (then the model's
    dtype), which is exact for the blocks GGUF stores as they are (a product of a float16 and an
    8-bit integer fits in float32's mantissa): the rows a dequantized copy of the table holds."""

    def __init__(self, weights: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 bits: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        tiles, groups, _ = weights.shape
        self.dtype = dtype  # of the rows it gives
        self.num_embeddings, self.embedding_dim = tiles * TILE, groups * GROUP
        self.bits = bits
        self.weights = nn.Buffer(weights)
        self.scales = nn.Buffer(scales)
        self.mins = nn.Buffer(mins)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        tiles, lanes = flat // TILE, flat % TILE
        rows = torch.arange(flat.shape[0], device=flat.device)
        u = self.weights[tiles]  # [N, groups, bytes]: each token's whole tile
        groups = u.shape[1]
        if self.bits == 4:  # chunks 2p and 2p+1 in the low and high nibbles of pair p
            pairs = u.view(-1, groups, GROUP // CHUNK // 2, 1, TILE, CHUNK)
            u = torch.cat([pairs & 15, pairs >> 4], dim=3)
        u = u.view(-1, groups, GROUP // CHUNK, TILE, CHUNK).permute(0, 3, 1, 2, 4)
        u = u[rows, lanes].reshape(-1, groups, GROUP)  # [N, groups, 32]: the token's row
        d = self.scales[tiles].transpose(1, 2)[rows, lanes]  # [N, groups]
        m = self.mins[tiles].transpose(1, 2)[rows, lanes]
        w = u.float() * d.float()[..., None] + m.float()[..., None]
        return w.reshape(*ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int{self.bits} groups of {GROUP}"


def fits(out_features: int, in_features: int) -> bool:
    """Whether the kernel takes a layer of this shape (whole tiles and groups)."""
    return out_features % TILE == 0 and in_features % GROUP == 0


def pack(blocks: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's layout: weights uint8 [tiles, groups, 512 or 256], scales and mins float16
    [tiles, groups, 16] (quant_linear.cpp describes it)."""
    out, size = blocks.shape
    if not fits(out, size):
        raise ValueError(f"a {out}x{size} layer is not whole tiles of {TILE} outputs and groups of "
                         f"{GROUP} inputs")
    tiles, groups, chunks = out // TILE, size // GROUP, GROUP // CHUNK
    u = blocks.values.view(tiles, TILE, groups, chunks, CHUNK).permute(0, 2, 3, 1, 4)
    if blocks.bits == 4:  # chunks 2p and 2p+1 in the low and high nibbles of pair p
        pairs = u.reshape(tiles, groups, chunks // 2, 2, TILE, CHUNK)
        u = pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)
    weights = u.reshape(tiles, groups, -1).contiguous()

    def per_tile(t: torch.Tensor) -> torch.Tensor:
        return t.view(tiles, TILE, groups).transpose(1, 2).contiguous()

    return weights, per_tile(blocks.scales.half()), per_tile(blocks.mins.half())


def unpack(weights: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
           bits: int) -> QuantizedWeight:
    """`pack`'s inverse."""
    tiles, groups, _ = weights.shape
    u = weights
    if bits == 4:
        pairs = u.view(tiles, groups, -1, 1, TILE, CHUNK)
        u = torch.cat([pairs & 15, pairs >> 4], dim=3)
    u = u.reshape(tiles, groups, GROUP // CHUNK, TILE, CHUNK).permute(0, 3, 1, 2, 4)

    def per_output(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(tiles * TILE, groups)

    return QuantizedWeight(u.reshape(tiles * TILE, groups * GROUP), per_output(scales),
                           per_output(mins), bits)


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """`norm` (an RMSNorm) of `x` as the quantized linears compute it in their op: over
    quantized linears every norm of an eager pass and of a compiled step runs this kernel, so
    both give a row the same bits (QuantLinear.forward says why that matters)."""
    return torch.ops.lmi_quant.rms_norm(x, norm.weight, norm.variance_epsilon)


@functools.cache
def available() -> bool:
    """Whether the kernel is loaded (built on first use, once per process)."""
    return native_build.load(SOURCE, "quantized weights are served dequantized to float",
                             {"lmi_quant::quant_linear": _shape,
                              "lmi_quant::rms_norm": _norm_shape})


def _shape(x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
           bits: int, norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """What torch.export traces the op as: [..., out] in the input's dtype."""
    return x.new_empty((*x.shape[:-1], weights.shape[0] * TILE))


def _norm_shape(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What torch.export traces the norm as: `x`'s shape and dtype."""
    return torch.empty_like(x)
