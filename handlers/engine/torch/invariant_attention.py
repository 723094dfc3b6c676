"""Attention over the slot KV cache on the CPU whose result for a query is the same whatever else
is in its pass.

torch's CPU attention (SDPA's flash kernel, or the GEMMs of attention written out in torch) blocks
its work by the pass's shapes: the padded key length (the batch's longest sequence), the number of
queries in a chunk and a query's place in it. Sums then round differently, ~1e-7 apart in
float32. A bf16 model rounds each attention output to bf16, where such differences flip
roundings and, some tokens later, the text: 4 of 32 greedy SmolLM2 answers changed with their
batch (AMD EPYC Zen 4). invariant_attention.cpp computes each (row, query, head) over exactly the
keys it sees, in one fixed order, as the torch op `lmi::slot_attention`.

The C++ is compiled here on first use against this torch's headers (g++, ~6 s; cached in
$LMI_CACHE_DIR/kernels by source, compiler, torch and CPU) and loaded into torch's op registry:
eager passes and the compiled decode step (torch.export, AOTInductor) call it without Python.
Where it cannot be built, `available()` is False, logged, and attention stays on SDPA.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from handlers.engine import native_build

SOURCE = Path(__file__).with_name("invariant_attention.cpp")
MAX_HEAD_SIZE = 256  # the kernel holds a query's elements in 16 vector registers
# The caches the kernel reads as they are (16 and 8 bits widened to float32 exactly as read).
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                torch.float8_e5m2)


def slot_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   counts: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of query [B, H, T, D] over key/value [B, H_kv, S, D] (a cache view), query
    (b, t) seeing the first counts[b, t] keys: [B, T, H, D] in the query's dtype. float32 and
    bfloat16 queries run as they are, other queries in float32; the kernel reads CACHE_DTYPES'
    caches, others are widened to float32 first."""
    if query.dtype not in (torch.float32, torch.bfloat16):
        return slot_attention(query.float(), key, value, counts, scale).to(query.dtype)
    if key.dtype not in CACHE_DTYPES or key.stride(-1) != 1 or key.stride(-2) != key.shape[-1] \
            or value.stride() != key.stride() or value.dtype != key.dtype:
        key, value = key.float().contiguous(), value.float().contiguous()
    if query.stride(-1) != 1:
        query = query.contiguous()
    return torch.ops.lmi.slot_attention(query, key, value, counts.long().contiguous(), scale)


@functools.cache
def available() -> bool:
    """Whether the op is loaded (built on first use, once per process)."""
    return native_build.load(SOURCE, "CPU attention runs on SDPA, whose results for a row "
                             "depend slightly on the rest of its batch",
                             {"lmi::slot_attention": _shape})


def _shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, counts: torch.Tensor,
           scale: float) -> torch.Tensor:
    """What torch.export traces the op as: [B, T, H, D] in the query's dtype."""
    batch, heads, width, size = query.shape
    return query.new_empty((batch, width, heads, size))
