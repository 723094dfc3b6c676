"""The forward pass of a Llama-architecture decoder over the slot KV cache, written as one loop
over its layers' weights instead of calls through transformers' module tree.

At a few rows a CPU decode step is mostly not arithmetic: SmolLM2's 30 layers through
transformers' modules spent ~10 ms of a ~42 ms one-row step in Python between the ops (module
calls, keyword plumbing, output capture). This loop runs the same ops in the same order on the
same modules' weights (fused projections, oneDNN linears), so its results are bit-for-bit those
of transformers' forward; architectures other than `LlamaForCausalLM` keep that forward. The
modules are transformers' or llama_model.py's (the same names and weights); llama_model.py's
also carry the GGUFs gguf_model.py builds as Llama layers: Qwen2's q/k/v biases (in the
quantized linears), Qwen3's per-head q/k norms (here, before the rotation, as transformers'
Qwen3 computes them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.functional import rms_norm

from handlers.engine.torch import quant_linear
from handlers.engine.torch.attention import slot_cache_attention
from handlers.engine.torch.fused_projections import ProjectionPart
from handlers.engine.torch.kv_cache import SlotKVCache
from handlers.engine.torch.llama_model import is_llama, rotate_half
from handlers.engine.torch.quant_linear import QuantLinear


@dataclass
class _Layer:
    norm_in: nn.Module
    qkv: nn.Module
    q_heads: int
    qk_heads: int  # query and key heads, the first of the fused projection's output
    out: nn.Module
    norm_post: nn.Module
    gate_up: nn.Module
    mlp_sizes: list[int]
    down: nn.Module
    act: nn.Module
    q_norm: nn.Module | None  # Qwen3's per-head norms of queries and keys (else None)
    k_norm: nn.Module | None

    @staticmethod
    def of(layer: nn.Module, head_dim: int) -> _Layer:
        qkv, gate_up = layer.self_attn.q_proj.shared, layer.mlp.gate_proj.shared
        return _Layer(norm_in=layer.input_layernorm, qkv=qkv, q_heads=qkv.sizes[0] // head_dim,
                      qk_heads=sum(qkv.sizes[:2]) // head_dim, out=layer.self_attn.o_proj,
                      norm_post=layer.post_attention_layernorm, gate_up=gate_up,
                      mlp_sizes=gate_up.sizes, down=layer.mlp.down_proj, act=layer.mlp.act_fn,
                      q_norm=getattr(layer.self_attn, "q_norm", None),
                      k_norm=getattr(layer.self_attn, "k_norm", None))


class LlamaStack:
    def __init__(self, model: nn.Module, positions: int) -> None:
        decoder = model.model
        self.embed = decoder.embed_tokens
        self.norm = decoder.norm
        attention = decoder.layers[0].self_attn
        self.head_dim, self.scaling = attention.head_dim, attention.scaling
        self.layers = [_Layer.of(layer, self.head_dim)
                       for layer in decoder.layers[: model.config.num_hidden_layers]]
        self.rotary = _RotaryTable.of(decoder.rotary_emb, positions, model.dtype, model.device)
        # Over quantized linears an eager and a compiled pass must round alike: their norms
        # run the quantized linears' kernel in both (QuantLinear.forward).
        self.exact_norms = any(isinstance(m, QuantLinear) for m in model.modules()) \
            and model.dtype == torch.float32

    @staticmethod
    def of(model: nn.Module, positions: int) -> LlamaStack | None:
        """The stack for `model` (positions 0..`positions`-1) when it is a Llama whose
        projections were fused, else None."""
        if not is_llama(model):
            return None
        layers = model.model.layers
        fused = all(isinstance(layer.self_attn.q_proj, ProjectionPart)
                    and isinstance(layer.mlp.gate_proj, ProjectionPart) for layer in layers)
        return LlamaStack(model, positions) if fused else None

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache: SlotKVCache) -> torch.Tensor:
        """The final hidden states [B, T, hidden] of tokens `ids` [B, T] at `positions`."""
        x = self.embed(ids)
        cos, sin = self.rotary(x, position_ids=positions)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, T, 1, D]: one angle for every head
        rows, width = ids.shape
        counts = positions + 1  # a slot holds its sequence from position 0: keys 0..p
        for index, layer in enumerate(self.layers):
            qkv = self._project(layer.qkv.fused, layer.norm_in, x)
            qkv = qkv.view(rows, width, -1, self.head_dim)
            qk = qkv[:, :, : layer.qk_heads]  # queries and keys rotate as one tensor
            if layer.q_norm is not None:  # each head normed before it rotates (Qwen3)
                qk = torch.cat([self._rms_norm(layer.q_norm, qk[:, :, : layer.q_heads]),
                                self._rms_norm(layer.k_norm, qk[:, :, layer.q_heads :])], dim=2)
            qk = qk * cos + rotate_half(qk) * sin
            q, k = qk[:, :, : layer.q_heads].transpose(1, 2), qk[:, :, layer.q_heads :]
            k, v = cache.update(k.transpose(1, 2), qkv[:, :, layer.qk_heads :].transpose(1, 2),
                                index)
            a, _ = slot_cache_attention(None, q, k, v, mask, scaling=self.scaling,
                                        counts=counts)
            x = x + layer.out(a.reshape(rows, width, -1))
            gate, up = self._project(layer.gate_up.fused, layer.norm_post, x).split(
                layer.mlp_sizes, dim=-1)
            x = x + layer.down(layer.act(gate) * up)
        return self._rms_norm(self.norm, x)

    def _project(self, linear: nn.Module, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`linear`(`norm`(x)); a quantized linear computes the norm in its own op (a LoRA-
        wrapped one reads the norm's output too: the same kernel first)."""
        if self.exact_norms and isinstance(linear, QuantLinear):
            return linear(x, norm)
        return linear(self._rms_norm(norm, x))

    def _rms_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm; in float32 one op (torch's gives the same bits in fewer calls),
        over quantized linears theirs, which a compiled step cannot rewrite."""
        if x.dtype != torch.float32:
            return norm(x)
        if self.exact_norms:
            return quant_linear.rms_norm(x, norm)
        return rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


class _RotaryTable:
    """The rotary embedding's cos and sin for every position, computed once by the model's own
    module and looked up by position: an eager pass and a compiled step then read the same
    values (a compiled step computing them itself rounds some cos and sin differently), and a
    step computes no cos or sin. Rope types that rescale with the sequence's length (dynamic,
    longrope) are computed each pass, by their module."""

    def __init__(self, rotary: nn.Module, cos: torch.Tensor | None, sin: torch.Tensor | None):
        self.rotary, self.cos, self.sin = rotary, cos, sin

    @staticmethod
    def of(rotary: nn.Module, positions: int, dtype: torch.dtype,
           device: torch.device) -> _RotaryTable:
        kind = str(getattr(rotary, "rope_type", "default"))
        if "dynamic" in kind or kind == "longrope":
            return _RotaryTable(rotary, None, None)
        with torch.no_grad():
            cos, sin = rotary(torch.empty(0, dtype=dtype, device=device),
                              position_ids=torch.arange(positions, device=device)[None])
        return _RotaryTable(rotary, cos[0], sin[0])

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor):
        """cos and sin [B, T, head_dim] at `position_ids` [B, T]."""
        if self.cos is None:
            return self.rotary(x, position_ids=position_ids)
        return self.cos[position_ids], self.sin[position_ids]
