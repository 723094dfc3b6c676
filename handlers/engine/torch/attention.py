"""Attention over a float32 KV cache for models that run in bfloat16 / float16 on the CPU.

bf16 attention rounds its softmax weights to bf16 in blocks that depend on the batch's longest
sequence, so a row's logits drift with what else is in the batch. Keys and values are cached in
float32 (an exact up-cast) and attention runs in float32; only its output is cast back. This
makes the drift much smaller, not zero: the kernels' blocking still depends on the padded length.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "lmi_float32_kv"


def float32_kv_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs):
    out, weights = sdpa_attention_forward(module, query.to(key.dtype), key, value,
                                          attention_mask, **kwargs)
    return out.to(query.dtype), weights


def use_float32_kv(model: torch.nn.Module) -> None:
    """Route the model's attention through `float32_kv_attention`."""
    AttentionInterface.register(NAME, float32_kv_attention)
    model.set_attn_implementation(NAME)
