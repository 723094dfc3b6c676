"""A Llama-architecture checkpoint built from its config.json and safetensors files, without
transformers' modeling code, for the CPU path where `LlamaStack` runs the layers.

Importing transformers' `LlamaForCausalLM` takes ~6 s of a ~10 s start (its modeling and
generation modules, and through them scikit-learn, accelerate and torch.distributed): more than
importing torch and loading the weights together. The modules here have the names and weights of
transformers' (`model.layers.N.self_attn.q_proj`, ...), so fusing, oneDNN packing, the stack and
the compiled decode step treat both alike; norms and rotary angles compute what transformers'
do, op for op. A checkpoint this does not cover (another rope type, biases, remote code,
quantization) is loaded by transformers, as is every model off the CPU. The GGUFs gguf_model.py
serves from their blocks are built here too: Qwen2's and Qwen3's and Phi-3's layers are Llama's
with biases in the quantized linears, per-head q/k norms (`qk_norm`) or joined projections, and
Llama 3's rope scaling is its file's frequency factors (`RotaryAngles`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from handlers.engine.torch.checkpoint_files import Checkpoint
from handlers.engine.torch.fused_projections import GROUPS, SharedProjection, share
from handlers.engine.torch.quant_linear import QuantEmbedding, QuantLinear, fits

ARCHITECTURE = "LlamaForCausalLM"
_TRANSFORMERS_LLAMA = "transformers.models.llama.modeling_llama"
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "vocab_size")


@dataclass(frozen=True)
class LlamaSettings:
    """The config.json values the forward pass reads (transformers' LlamaConfig defaults)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_id: int | list[int] | None
    # Qwen3's RMSNorm of each query and key head before the rotary embedding (a GGUF's
    # attn_q_norm / attn_k_norm: gguf_model.py); safetensors checkpoints built here have none.
    qk_norm: bool = False

    def get_text_config(self) -> LlamaSettings:  # what ModelRunner asks a transformers config
        return self


def unsupported(directory: Path) -> str | None:
    """Why `directory`'s checkpoint is not one this module builds (None when it is)."""
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as error:
        return f"config.json unreadable ({error})"
    if raw.get("architectures") != [ARCHITECTURE] or raw.get("model_type") != "llama":
        return f"architecture {raw.get('architectures')}"
    checks = {
        "remote code (auto_map)": "auto_map" in raw,
        "quantized": "quantization_config" in raw,
        "missing sizes": any(key not in raw for key in _REQUIRED),
        "biases": raw.get("attention_bias") or raw.get("mlp_bias"),
        f"activation {raw.get('hidden_act')}": raw.get("hidden_act", "silu") != "silu",
        f"rope {_rope(raw)}": _rope(raw)[0] != "default",
        "no safetensors": not _weight_files(directory),
    }
    return next((why for why, failed in checks.items() if failed), None)


def settings(directory: Path) -> LlamaSettings:
    raw = json.loads((directory / "config.json").read_text())
    heads = raw["num_attention_heads"]
    return LlamaSettings(
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        vocab_size=raw["vocab_size"], rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=_rope(raw)[1], tie_word_embeddings=raw.get("tie_word_embeddings", False),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        eos_token_id=raw.get("eos_token_id"),
    )  # fmt: skip


def _rope(raw: dict) -> tuple[str, float]:
    """(rope type, theta) from transformers 5's `rope_parameters` or the older keys."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    return kind, float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / shard for shard in shards]
    single = directory / "model.safetensors"
    return [single] if single.is_file() else []


def is_llama(model: nn.Module) -> bool:
    """Built here, or transformers' own Llama class exactly (not remote code or a subclass)."""
    kind = type(model)
    return kind is LlamaCausalLM or (kind.__name__ == ARCHITECTURE
                                     and kind.__module__ == _TRANSFORMERS_LLAMA)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The rotary embedding's partner of each element: (-second half, first half)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # in float32, then back: transformers'
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class RotaryAngles(nn.Module):
    """cos and sin of each position's rotary angles, [B, T, head_dim], in the input's dtype;
    `factors` (a GGUF's `rope_freqs`: Llama 3's rope scaling, as llama.cpp applies it) divide
    each frequency."""

    def __init__(self, head_dim: int, theta: float, factors: torch.Tensor | None = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        if factors is not None:
            inv_freq = inv_freq / factors.float()
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


class Attention(nn.Module):
    def __init__(self, s: LlamaSettings) -> None:
        super().__init__()
        self.head_dim, self.scaling = s.head_dim, s.head_dim**-0.5
        kv = s.num_key_value_heads * s.head_dim
        self.q_proj = nn.Linear(s.hidden_size, s.num_attention_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, kv, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, kv, bias=False)
        self.o_proj = nn.Linear(s.num_attention_heads * s.head_dim, s.hidden_size, bias=False)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
            self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, s: LlamaSettings) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)
        self.act_fn = nn.SiLU()


class DecoderLayer(nn.Module):
    def __init__(self, s: LlamaSettings) -> None:
        super().__init__()
        self.self_attn, self.mlp = Attention(s), MLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class Decoder(nn.Module):
    def __init__(self, s: LlamaSettings, rotary: RotaryAngles) -> None:
        super().__init__()
        # Not nn.Embedding(...): its random init on the meta device imports torch._dynamo (1.5 s).
        self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(s.vocab_size, s.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.num_hidden_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.rotary_emb = rotary


class LlamaCausalLM(nn.Module):
    """The weights of a Llama causal LM; `LlamaStack` runs them (there is no forward here)."""

    def __init__(self, s: LlamaSettings, generation: dict, rotary: RotaryAngles) -> None:
        super().__init__()
        self.config = s
        self.generation_config = SimpleNamespace(eos_token_id=generation.get("eos_token_id"))
        self.model = Decoder(s, rotary)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        if s.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # The final norm's: the linears may have been replaced by packed ones (onednn_linear.py),
    # the embedding too (a GGUF's blocks: gguf_model.py).
    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def get_decoder(self) -> Decoder:
        return self.model

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head


def load(directory: Path, dtype: torch.dtype,
         widths: Callable[[str], int | None] | None = None) -> LlamaCausalLM:
    """The checkpoint in `directory` (which `unsupported` accepted) in `dtype`, in eval mode,
    read a tensor at a time (checkpoint_files.py), each layer's q/k/v and gate/up read into one
    joined projection (fused_projections.py), as they are served. `widths`: the bits a linear
    layer (by module name) is quantized to as it is read, None to keep it float; with it, the
    token embedding is read into 8-bit blocks too (`QuantEmbedding`), which a tied head shares."""
    config = settings(directory)
    generation_file = directory / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
    rotary = RotaryAngles(config.head_dim, config.rope_theta)  # computed: not on meta
    with torch.device("meta"):  # the weights come from the files: allocate none here
        model = LlamaCausalLM(config, generation, rotary)
    with Checkpoint(_weight_files(directory)) as checkpoint:
        for parent, names in _linear_groups(model):
            modules = [f"{parent}.{name}" if parent else name for name in names]
            linear = _read_linear(checkpoint, modules, dtype, widths)
            if len(names) == 1:
                model.set_submodule(modules[0], linear)
            else:
                sizes = [checkpoint.entries[f"{m}.weight"].shape[0] for m in modules]
                share(model.get_submodule(parent), names, SharedProjection.over(linear, sizes))
        _read_embedding(model, checkpoint, dtype, widths is not None)
        norms = {name: checkpoint.read([name], dtype) for name in checkpoint.entries
                 if name.endswith("norm.weight")}
    model.load_state_dict(norms, strict=False, assign=True)
    missing = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    if missing:
        raise ValueError(f"{directory}: the checkpoint has no tensors for {', '.join(missing[:5])}")
    return model.eval()


_EMBEDDING_BITS = 8  # a quantized model's token embedding (and a tied head): as llama.cpp's files


def _linear_groups(model: LlamaCausalLM) -> list[tuple[str, tuple[str, ...]]]:
    """(parent module, projections read together) of every layer, and the head where untied."""
    groups = []
    for index in range(model.config.num_hidden_layers):
        layer = f"model.layers.{index}"
        groups += [(f"{layer}.self_attn", GROUPS[0]), (f"{layer}.self_attn", ("o_proj",)),
                   (f"{layer}.mlp", GROUPS[1]), (f"{layer}.mlp", ("down_proj",))]
    if not model.config.tie_word_embeddings:
        groups.append(("", ("lm_head",)))
    return groups


def _read_linear(checkpoint: Checkpoint, modules: list[str], dtype: torch.dtype,
                 widths: Callable[[str], int | None] | None) -> nn.Module:
    """One linear layer computing `modules`' outputs one after another: quantized blocks where
    `widths` gives their width and the kernel takes the shape, else float in `dtype`."""
    names = [f"{module}.weight" for module in modules]
    rows = sum(checkpoint.entries[name].shape[0] for name in names)
    size = checkpoint.entries[names[0]].shape[1]
    bits = {widths(module) for module in modules} if widths else {None}
    if None not in bits and all(fits(checkpoint.entries[n].shape[0], size) for n in names):
        width = max(bits)
        return QuantLinear.packed(*checkpoint.quantized(names, width), width)
    with torch.device("meta"):
        linear = nn.Linear(size, rows, bias=False, dtype=dtype)
    linear.weight = nn.Parameter(checkpoint.read(names, dtype), requires_grad=False)
    return linear


def _read_embedding(model: LlamaCausalLM, checkpoint: Checkpoint, dtype: torch.dtype,
                    quantize: bool) -> None:
    """The token embedding, and a tied head over it (the file may lack the head, or repeat it)."""
    name = "model.embed_tokens.weight"
    shape = checkpoint.entries[name].shape
    if quantize and fits(*shape):
        packed = checkpoint.quantized([name], _EMBEDDING_BITS)
        model.model.embed_tokens = QuantEmbedding(*packed, _EMBEDDING_BITS, dtype)
        if model.config.tie_word_embeddings:
            model.lm_head = QuantLinear.packed(*packed, _EMBEDDING_BITS)
        return
    weight = nn.Parameter(checkpoint.read([name], dtype), requires_grad=False)
    model.model.embed_tokens.weight = weight
    if model.config.tie_word_embeddings:
        model.lm_head.weight = weight  # one parameter, as transformers' tied head
