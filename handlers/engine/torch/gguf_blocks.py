"""A GGUF's quantized linear layers as `QuantizedWeight` blocks, repacked, not dequantized to float.

Q4_0, Q4_1 and Q8_0 are d * u + m blocks of 32 already; Q4_K's 256-element super-blocks are eight
such blocks (their scale d * sc rounded to float16, ~0.05% of it); Q6_K, Q5_* and the other
types have no 4- or 8-bit form of their own and are quantized again to 8 bits from their values.
Float tensors (F32, F16, BF16) stay float. Names are transformers' (`model.layers.N.mlp.up_proj`),
and the q/k rows that llama.cpp's converter interleaves for its rotary layout are put back in
transformers' order, as transformers' own GGUF loader does.

Reading a GGUF's header takes seconds (gguf's reader parses the whole vocabulary), so the blocks
are cached once per file, beside its float conversion (handlers/engine/gguf/cache.py).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Kind
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open
from safetensors.torch import save_file

from handlers.engine.gguf.cache import gguf_cache_entry
from handlers.engine.torch.quant_blocks import QuantizedWeight, from_float

_CACHE_FORMAT = "blocks-v1"  # bump when what read_blocks gives changes
_FIELDS = ("values", "scales", "mins")

FLOAT_KINDS = {Kind.F32, Kind.F16, Kind.BF16}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
LINEAR_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def cached_blocks(path: Path, heads: int, kv_heads: int,
                  cache_dir: Path | None = None) -> dict[str, QuantizedWeight]:
    """`read_blocks`, from the cache where an earlier start left them."""
    entry = gguf_cache_entry(path, cache_dir)
    file = entry.parent / f"{entry.name}.{_CACHE_FORMAT}.safetensors"
    if file.is_file():
        with safe_open(file, "pt") as stored:
            return {name: QuantizedWeight(*(stored.get_tensor(f"{name}.{field}")
                                            for field in _FIELDS), int(bits))
                    for name, bits in stored.metadata().items()}
    blocks = read_blocks(path, heads, kv_heads)
    tensors = {f"{name}.{field}": getattr(weight, field).contiguous()
               for name, weight in blocks.items() for field in _FIELDS}
    file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=file.parent, suffix=".partial", delete=False) as tmp:
        pass
    save_file(tensors, tmp.name, metadata={name: str(w.bits) for name, w in blocks.items()})
    os.replace(tmp.name, file)  # whole, or not there
    return blocks


def read_blocks(path: Path, heads: int, kv_heads: int) -> dict[str, QuantizedWeight]:
    """The quantized linear layers of the Llama-architecture GGUF at `path`, by transformers'
    module name (`lm_head` from `output`, else from the tied `token_embd`)."""
    reader = GGUFReader(path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    blocks: dict[str, QuantizedWeight] = {}
    for name, tensor in tensors.items():
        target = _module_name(name, "output.weight" in tensors)
        if target is None or tensor.tensor_type in FLOAT_KINDS:
            continue
        weight = to_blocks(np.asarray(tensor.data), tensor.tensor_type)
        if target.endswith(("q_proj", "k_proj")):
            weight = weight.rows(unpermuted(weight.shape[0],
                                             heads if target.endswith("q_proj") else kv_heads))
        blocks[target] = weight
    return blocks


def _module_name(name: str, has_output: bool) -> str | None:
    if name == "output.weight" or (name == "token_embd.weight" and not has_output):
        return "lm_head"
    match = _LAYER.fullmatch(name)
    if match is None or match[2] not in LINEAR_NAMES:
        return None
    return f"model.layers.{match[1]}.{LINEAR_NAMES[match[2]]}"


def unpermuted(rows: int, heads: int) -> torch.Tensor:
    """The row order undoing llama.cpp's converter's permutation of a q or k projection."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def to_blocks(raw: np.ndarray, kind: Kind) -> QuantizedWeight:
    """One tensor's raw bytes [out, bytes per row] as blocks of 32."""
    repack = _REPACK.get(kind)
    if repack is not None:
        return repack(raw)
    values = dequantize(raw, kind)  # [out, in] float32
    return from_float(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)), 8)


def _split(raw: np.ndarray, size: int) -> np.ndarray:
    """[out, blocks, size]: each row's blocks."""
    return raw.reshape(raw.shape[0], -1, size)


def _half(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: the low nibbles are elements 0..15, the high ones 16..31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _weight(u: np.ndarray, d: np.ndarray, m: np.ndarray, bits: int) -> QuantizedWeight:
    out = u.shape[0]
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(u.reshape(out, -1))),
                           torch.from_numpy(np.ascontiguousarray(d.reshape(out, -1))),
                           torch.from_numpy(np.ascontiguousarray(m.reshape(out, -1))), bits)


def _q4_0(raw: np.ndarray) -> QuantizedWeight:
    b = _split(raw, 18)
    d = _half(b[..., 0:2])
    return _weight(_nibbles(b[..., 2:]), d, d * np.float16(-8), 4)


def _q4_1(raw: np.ndarray) -> QuantizedWeight:
    b = _split(raw, 20)
    return _weight(_nibbles(b[..., 4:]), _half(b[..., 0:2]), _half(b[..., 2:4]), 4)


def _q8_0(raw: np.ndarray) -> QuantizedWeight:
    b = _split(raw, 34)
    d = _half(b[..., 0:2])
    u = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return _weight(u, d, d * np.float16(-128), 8)


def _q4_k(raw: np.ndarray) -> QuantizedWeight:
    """Super-blocks of 256: d, dmin, 8 six-bit (scale, min) pairs packed in 12 bytes, then 128
    bytes holding sub-blocks 2i and 2i+1 in the low and high nibbles of bytes 32i..32i+31."""
    b = _split(raw, 144)
    d, dmin = _half(b[..., 0:2]).astype(np.float32), _half(b[..., 2:4]).astype(np.float32)
    s = b[..., 4:16].astype(np.uint8)
    low = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mins = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = b[..., 16:].reshape(*b.shape[:2], 4, 32)
    u = np.stack([qs & 15, qs >> 4], axis=-2)  # [out, super, 4, 2, 32]: sub-blocks in order
    scale = (d[..., None] * low).astype(np.float16)
    minimum = (-dmin[..., None] * mins).astype(np.float16)
    return _weight(u, scale, minimum, 4)


_REPACK = {Kind.Q4_0: _q4_0, Kind.Q4_1: _q4_1, Kind.Q8_0: _q8_0, Kind.Q4_K: _q4_k}
# The types the kernel takes as they are (the rest are quantized again to 8 bits).
REPACKED_AS_THEY_ARE = tuple(kind.name for kind in _REPACK)
