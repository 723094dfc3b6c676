"""Attention over the slot KV cache on the CPU: every query over exactly the keys it sees, with
a result that does not depend on the rest of its pass.

Each query of a slot-cache pass sees a prefix of its slot (the sequence's positions 0..p), so a
pass gives attention the count of keys each query sees, and invariant_attention.py's kernel
computes every (row, query, head) on its own: a sequence's tokens do not depend on what else is
in the batch, in float32 or in bf16. Keys and values are read in place from the cache (grouped
query heads included) in its dtype (option.kv_cache_dtype: kv_dtype.py), widened exactly to
float32 as they are read. The kernel computes in float32 and only its output is cast back.

Where the kernel cannot be built, attention runs on torch's SDPA in float32 over the cache
widened to it (`enable_gqa`: transformers' SDPA path copies grouped KV heads whenever a
mask is passed, more than half of a 32-row decode step), whose results drift ~1e-7 with the
batch's padded length.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch.nn.functional import scaled_dot_product_attention

from handlers.engine.torch.invariant_attention import MAX_HEAD_SIZE, available, slot_attention
from handlers.engine.torch.llama_model import LlamaCausalLM

NAME = "lmi_slot_cache"
# How many keys each query [B, T] of the current slot-cache pass sees, for attention called
# through transformers' modules (LlamaStack passes it itself).
_VISIBLE: ContextVar[torch.Tensor | None] = ContextVar("visible_keys", default=None)


@contextlib.contextmanager
def visible_keys(counts: torch.Tensor) -> Iterator[None]:
    token = _VISIBLE.set(counts)
    try:
        yield
    finally:
        _VISIBLE.reset(token)


def slot_cache_attention(module: torch.nn.Module | None, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         scaling: float | None = None, counts: torch.Tensor | None = None,
                         **kwargs):
    """Attention of `query` [B, H, T, D] over `key`/`value` [B, H_kv, S, D], query (b, t)
    seeing the first `counts[b, t]` keys (else those `attention_mask` leaves); returns
    [B, T, H, D] in the query's dtype."""
    counts = _VISIBLE.get() if counts is None else counts
    if attention_mask is None or kwargs.get("position_bias") is not None:
        # Not a slot-cache pass (ours always has a mask: generate() on the same model, say), or
        # a model with learned biases: transformers' own path.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        dtype = key.dtype if key.dtype in (torch.float32, torch.bfloat16) else torch.float32
        out, weights = sdpa_attention_forward(module, query.to(dtype), key.to(dtype),
                                              value.to(dtype), attention_mask, scaling=scaling,
                                              **kwargs)
        return out.to(query.dtype), weights
    if counts is not None and query.shape[-1] <= MAX_HEAD_SIZE and available():
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return slot_attention(query, key, value, counts, scale), None
    out = scaled_dot_product_attention(query.float(), key.float(), value.float(),
                                       attn_mask=attention_mask, scale=scaling,
                                       enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def use_slot_cache_attention(model: torch.nn.Module) -> None:
    """Route a transformers model's attention through `slot_cache_attention` (llama_model's
    modules have no forward: LlamaStack calls it)."""
    if isinstance(model, LlamaCausalLM):
        return
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, slot_cache_attention)
    model.set_attn_implementation(NAME)
