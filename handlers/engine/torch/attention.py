"""Attention over the slot KV cache on the CPU: grouped-query heads read in place, and a float32
cache under 16-bit models.

transformers' SDPA path repeats a grouped-query model's key/value heads into full copies
whenever a mask is passed (always, here): on SmolLM2 (9 query heads over 3 KV heads) those copies
took more than half of a 32-row decode step past ~96 cached tokens (copy_ ~210 ms of ~380).
`scaled_dot_product_attention(enable_gqa=True)` reads the cache's views as they are, with the
same results.

bf16 attention rounds its softmax weights to bf16 in blocks that depend on the batch's longest
sequence, so a row's logits drift with what else is in the batch. Under a 16-bit model keys and
values are cached in float32 (an exact up-cast) and attention runs in float32; only its output
is cast back. This makes the drift much smaller, not zero: the kernels' blocking still depends
on the padded length.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

from handlers.engine.torch.llama_model import LlamaCausalLM

NAME = "lmi_slot_cache"


def slot_cache_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         scaling: float | None = None, **kwargs):
    """Attention of `query` [B, H, T, D] over `key`/`value` [B, H_kv, S, D] in the keys' dtype;
    returns [B, T, H, D] in the query's dtype."""
    if attention_mask is None or kwargs.get("position_bias") is not None:
        # Not a slot-cache pass (ours always has a mask: generate() on the same model, say), or
        # a model with learned biases: transformers' own path.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out, weights = sdpa_attention_forward(module, query.to(key.dtype), key, value,
                                              attention_mask, scaling=scaling, **kwargs)
        return out.to(query.dtype), weights
    out = scaled_dot_product_attention(query.to(key.dtype), key, value, attn_mask=attention_mask,
                                       scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def use_slot_cache_attention(model: torch.nn.Module) -> None:
    """Route a transformers model's attention through `slot_cache_attention` (llama_model's
    modules have no forward: LlamaStack calls it)."""
    if isinstance(model, LlamaCausalLM):
        return
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, slot_cache_attention)
    model.set_attn_implementation(NAME)
