"""A GGUF served from its own blocks: never dequantized whole, no float copy of the model in
memory or on disk.

The architectures are those whose layers llama_model.py and llama_stack.py run (the fast path,
with the compiled decode step): `llama` (Llama 2 and 3, Mistral, SmolLM; Llama 3's `rope_freqs`
divide the rotary frequencies, as llama.cpp applies them), `qwen2` (q/k/v biases, float, added
to the kernel's outputs), `qwen3` (a norm of each query and key head) and `phi3` (q/k/v and
gate/up joined in the file, taken as they are). Only llama's q/k rows were interleaved by
llama.cpp's converter (transformers' GGUF loader undoes it for llama alone, as here). What this
module does not build raises `Unsupported`, and the loader dequantizes the file instead.

The file is read once, a tensor at a time (`os.pread`: the page cache holds what was read, not
this process), each linear's blocks repacked into the quantized kernel's layout
(quant_linear.py) in chunks of rows, so a start's peak is the packed model plus one chunk. The
token embedding stays in its blocks too: a token's row is gathered and dequantized when it is
embedded (`QuantEmbedding`), and a tied output head runs the kernel over the same buffers. Only
the norms, biases and rope factors are float (float32, as the file has them). The config comes
from the GGUF's metadata; the tokenizer is transformers' conversion of it
(handlers/engine/gguf/cache.py).

Each layer's q/k/v and gate/up are stored joined, as fused_projections.py joins them to serve:
the server then maps the joined buffers, where joining them after loading would copy them and
keep the parts' pages resident beside the copy (1.6x the blocks, measured).

The packed model is cached once per file and mode (`<cache>/gguf-packed/<sha256>-<mode>-v3`): its
size is the blocks' (a scale and a min per 32 weights: Q4_0's blocks grow 11%, Q8_0's 6%), and a
later start maps it (`torch.load(mmap=True)`) instead of reading the GGUF's header again, which
takes seconds (the reader parses the whole vocabulary).

What the kernel has no form for (Q5_*, Q6_K, ...) is quantized again to 8 bits from its values,
chunk by chunk, as gguf_blocks.py does for the path that dequantizes; the log says which.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from itertools import product
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from handlers.engine.gguf.cache import gguf_cache_entry
from handlers.engine.torch import gguf_blocks, quant_linear
from handlers.engine.torch.fused_projections import GROUPS, SharedProjection, share
from handlers.engine.torch.llama_model import LlamaCausalLM, LlamaSettings, RotaryAngles
from handlers.engine.torch.quant_blocks import QuantizedWeight
from handlers.engine.torch.quant_linear import TILE, QuantEmbedding, QuantLinear

log = logging.getLogger(__name__)

_FORMAT = "v3"  # bump when what `_convert` writes changes
_CHUNK_ROWS = 1024  # rows repacked at a time (a multiple of TILE): bounds a start's extra memory
_PACKED = ("weights", "scales", "mins")
_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_BIASED = {"attn_q", "attn_k", "attn_v"}  # Qwen2's biases (float, added after the kernel)
# Phi-3's files hold q/k/v and gate/up joined already, as served (`_fuse`).
_JOINED = {"attn_qkv": "self_attn.q_proj+k_proj+v_proj", "ffn_up": "mlp.gate_proj+up_proj"}
_ROPE_FACTORS = "rope_freqs.weight"  # Llama 3's rope scaling: each frequency divided by its
_FUSED = (("self_attn", GROUPS[0]), ("mlp", GROUPS[1]))  # parent, projections read together
# The architectures this module builds: Llama's layers, with Qwen2's q/k/v biases, Qwen3's
# q/k norms, Phi-3's joined projections; only llama's q/k rows were permuted by the converter.
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3")
MODES = ("gguf", "int4", "int8")  # option.quantize values this path serves (int8: widened)


class Unsupported(ValueError):
    """The file is not one this module serves (the reason says why)."""


def load(path: Path, mode: str, dtype: torch.dtype,
         cache_dir: Path | None = None) -> LlamaCausalLM:
    """The model of the GGUF at `path` over its blocks (`mode`: one of MODES), its norms and
    embedded rows in `dtype`; `Unsupported` where this module does not serve it (the caller
    dequantizes it instead)."""
    entry = _entry(path, mode, cache_dir)
    verdict = entry.with_suffix(".unsupported")
    if verdict.is_file():  # remembered: the header is not parsed again to say so
        raise Unsupported(verdict.read_text())
    if entry.is_dir():
        return _build(*_mapped(entry), dtype)
    try:
        tensors, description = _convert(path, mode, entry)
    except Unsupported as why:
        _write_atomically(verdict, str(why))
        raise
    # Served from the tensors just packed: mapping the file instead would leave the memory
    # they took in the allocator's heap, resident beside the mapped pages.
    return _build(tensors, description, dtype)


def _entry(path: Path, mode: str, cache_dir: Path | None) -> Path:
    converted = gguf_cache_entry(path, cache_dir)
    widened = "int8" if mode == "int8" else "blocks"
    return converted.parent.parent / "gguf-packed" / f"{converted.name}-{widened}-{_FORMAT}"


def _mapped(entry: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The packed tensors cached at `entry`, mapped from its file, and what builds the model."""
    tensors = torch.load(entry / "model.pt", mmap=True, weights_only=True)
    return tensors, json.loads((entry / "model.json").read_text())


def _build(tensors: dict[str, torch.Tensor], saved: dict, dtype: torch.dtype) -> LlamaCausalLM:
    """The model over packed `tensors` (`saved`: `_convert`'s description of them)."""
    settings = LlamaSettings(**saved["settings"])
    rotary = RotaryAngles(settings.head_dim, settings.rope_theta,  # computed: not on meta
                          tensors.get(_ROPE_FACTORS))
    with torch.device("meta"):  # the weights come from the cache: allocate none here
        model = LlamaCausalLM(settings, saved["generation"], rotary)
    for name, width in saved["bits"].items():
        packed = [tensors[f"{name}.{field}"] for field in _PACKED]
        if name == "model.embed_tokens":
            model.model.embed_tokens = QuantEmbedding(*packed, width, dtype)
            continue
        bias = tensors.get(f"{name}.bias")
        linear = QuantLinear.packed(*packed, width, None if bias is None else bias.to(dtype))
        if name in saved["fused"]:
            parent, joined = name.rsplit(".", 1)
            share(model.get_submodule(parent), tuple(joined.split("+")),
                  SharedProjection.over(linear, saved["fused"][name]))
        else:
            model.set_submodule(name, linear)
    if settings.tie_word_embeddings:
        embedding = model.model.embed_tokens
        model.lm_head = QuantLinear.packed(embedding.weights, embedding.scales, embedding.mins,
                                           embedding.bits)
    norms = {name: tensor.to(dtype) for name, tensor in tensors.items()
             if name.endswith("norm.weight")}
    model.load_state_dict(norms, strict=False, assign=True)
    missing = [name for name, t in model.state_dict().items() if t.is_meta]
    if missing:
        raise ValueError(f"the packed GGUF has no tensors for {', '.join(missing[:5])}")
    return model.eval()


def _convert(path: Path, mode: str, entry: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Repack the GGUF at `path` into the cache entry `entry`, a tensor at a time; the packed
    tensors and their description (what `_build` takes)."""
    started = time.perf_counter()
    reader = GGUFReader(path, "r")
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    settings = settings_of(reader, tensors)
    arch = _field(reader, "general.architecture")
    log.info("Repacking the blocks of %s (%s) for the quantized kernel (first start; later "
             "starts map the cache)", path.name, arch)
    packed: dict[str, torch.Tensor] = {}
    bits: dict[str, int] = {}
    kinds: Counter[str] = Counter()
    with path.open("rb", buffering=0) as file:
        for name, tensor in tensors.items():
            target = _target(name, arch)
            if len(tensor.shape) == 1:  # a norm, a bias, rope factors: float32
                values = dequantize(_read(file, tensor), tensor.tensor_type)
                packed[target] = torch.from_numpy(values.astype(np.float32))
                continue
            heads = _permuted_heads(target, settings) if arch == "llama" else None
            *buffers, width = _packed(file, tensor, mode == "int8", heads)
            kinds[f"{tensor.tensor_type.name} as int{width}"] += 1
            module = target.removesuffix(".weight")
            bits[module] = width
            packed |= {f"{module}.{field}": buffer for field, buffer in zip(_PACKED, buffers,
                                                                           strict=True)}
    repacked = [kind for kind in kinds if not kind.startswith(gguf_blocks.REPACKED_AS_THEY_ARE)]
    log.info("Blocks of %s: %s%s", path.name, ", ".join(f"{n} {k}" for k, n in kinds.items()),
             f" ({', '.join(repacked)}: quantized again to 8 bits from their values, the "
             "kernel having no form of their own)" if repacked else "")
    fused = _fuse(packed, bits, settings)
    generation = {"eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id")}
    description = {"architecture": arch, "settings": vars(settings), "generation": generation,
                   "bits": bits, "fused": fused}
    _save(entry, packed, description)
    log.info("Repacked %s into %s in %.1f s", path.name, entry, time.perf_counter() - started)
    return packed, description


def _fuse(packed: dict[str, torch.Tensor], bits: dict[str, int],
          settings: LlamaSettings) -> dict[str, list[int]]:
    """Join each layer's q/k/v and gate/up in `packed` (their biases too) as
    fused_projections.py would at serving time (`QuantLinear.fused`), so that serving maps the
    joined buffers instead of copying them beside the parts it read; the joined layers' output
    sizes, by name (`parent.q_proj+k_proj+v_proj`). A file holding them joined (Phi-3) is
    taken as it is."""
    s = settings
    q, kv = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    group_sizes = {GROUPS[0]: [q, kv, kv], GROUPS[1]: [s.intermediate_size] * 2}
    sizes = {}
    for layer, (parent, names) in product(range(s.num_hidden_layers), _FUSED):
        name = f"model.layers.{layer}.{parent}.{'+'.join(names)}"
        sizes[name] = group_sizes[names]
        if name in bits:  # joined in the file
            continue
        modules = [f"model.layers.{layer}.{parent}.{part}" for part in names]
        parts = [QuantLinear.packed(*(packed.pop(f"{module}.{field}") for field in _PACKED),
                                    bits.pop(module), packed.pop(f"{module}.bias", None))
                 for module in modules]
        joined = QuantLinear.fused(parts)
        packed |= {f"{name}.{field}": getattr(joined, field) for field in _PACKED}
        if joined.bias is not None:
            packed[f"{name}.bias"] = joined.bias
        bits[name] = joined.bits
    return sizes


def settings_of(reader: GGUFReader, tensors: dict[str, ReaderTensor]) -> LlamaSettings:
    """The config of the GGUF's metadata; `Unsupported` for what llama_model.py and this
    module do not build."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise Unsupported(f"architecture {arch!r} (served from blocks: "
                          f"{', '.join(ARCHITECTURES)})")
    unknown = sorted(name for name in tensors if _target(name, arch) is None)
    if unknown:
        raise Unsupported(f"tensors this module does not build: {', '.join(unknown[:4])}")
    floats = sorted(name for name, t in tensors.items()
                    if t.tensor_type in gguf_blocks.FLOAT_KINDS and len(t.shape) > 1)
    if floats:
        raise Unsupported(f"float weights ({', '.join(floats[:3])}, ...)")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise Unsupported(f"rope scaling {scaling!r}")
    hidden = _field(reader, f"{arch}.embedding_length")
    heads = _field(reader, f"{arch}.attention.head_count")
    vocab = int(tensors["token_embd.weight"].shape[1])
    if vocab % TILE:
        raise Unsupported(f"a vocabulary of {vocab} (the kernel takes whole tiles of {TILE})")
    head_dim = _field(reader, f"{arch}.attention.key_length") or hidden // heads
    rotated = _field(reader, f"{arch}.rope.dimension_count") or head_dim
    if rotated != head_dim:
        raise Unsupported(f"a partial rotary embedding ({rotated} of {head_dim} dimensions)")
    context = _field(reader, f"{arch}.context_length") or 2048
    window = _field(reader, f"{arch}.attention.sliding_window")
    if window and window < context:  # Phi-3's: attention is exact within the window only
        log.info("%s attends a sliding window of %d tokens: served with a context of %d, not "
                 "%d", arch, window, window, context)
        context = window
    return LlamaSettings(
        hidden_size=hidden, intermediate_size=_field(reader, f"{arch}.feed_forward_length"),
        num_hidden_layers=_field(reader, f"{arch}.block_count"), num_attention_heads=heads,
        num_key_value_heads=_field(reader, f"{arch}.attention.head_count_kv") or heads,
        head_dim=head_dim, vocab_size=vocab,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon") or 1e-5),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base") or 10000.0),
        tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=context,
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
    )  # fmt: skip


def _field(reader: GGUFReader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _target(name: str, arch: str) -> str | None:
    """The module tensor `name` (a GGUF tensor's) becomes: transformers' names, as the model's
    (Phi-3's joined projections: `_fuse`'s)."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
           "output_norm.weight": "model.norm.weight", _ROPE_FACTORS: _ROPE_FACTORS}
    if name in top:
        return top[name]
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[3] not in ("weight", "bias"):
        return None
    _, layer, kind, suffix = parts
    if arch == "phi3" and kind in _JOINED:
        module = _JOINED[kind] if suffix == "weight" else None
    elif suffix == "bias":
        module = gguf_blocks.LINEAR_NAMES[kind] if arch == "qwen2" and kind in _BIASED else None
    else:
        module = _NORMS.get(kind) or gguf_blocks.LINEAR_NAMES.get(kind)
    return None if module is None else f"model.layers.{layer}.{module}.{suffix}"


def _permuted_heads(target: str, settings: LlamaSettings) -> int | None:
    """The heads whose rows llama.cpp's converter interleaved (q and k projections), else None."""
    if target.endswith("q_proj.weight"):
        return settings.num_attention_heads
    if target.endswith("k_proj.weight"):
        return settings.num_key_value_heads
    return None


def _read(file: BinaryIO, tensor: ReaderTensor, start: int = 0,
          size: int | None = None) -> np.ndarray:
    """`size` bytes of `tensor` from byte `start` (default: all of it), read from `file`."""
    size = tensor.n_bytes - start if size is None else size
    return np.frombuffer(os.pread(file.fileno(), size, tensor.data_offset + start),
                         dtype=np.uint8)


def _packed(file: BinaryIO, tensor: ReaderTensor, widen: bool,
            heads: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """`tensor`'s blocks in the kernel's layout (weights, scales, mins, bits), repacked
    `_CHUNK_ROWS` rows at a time; `heads`: undo the converter's q/k interleave (a projection
    that small is read whole)."""
    rows = int(tensor.shape[1])
    row_bytes = tensor.n_bytes // rows
    if rows % TILE:
        raise Unsupported(f"{tensor.name}: {rows} rows (the kernel takes whole tiles of {TILE})")
    whole = None
    if heads is not None:
        order = gguf_blocks.unpermuted(rows, heads).numpy()
        whole = _read(file, tensor).reshape(rows, row_bytes)[order]
    packed: list[torch.Tensor] = []  # weights, scales, mins: allocated once, filled by chunks
    width = 8
    for first in range(0, rows, _CHUNK_ROWS):
        count = min(_CHUNK_ROWS, rows - first)
        raw = whole[first:first + count] if whole is not None else _read(
            file, tensor, first * row_bytes, count * row_bytes).reshape(count, row_bytes)
        blocks = gguf_blocks.to_blocks(raw, tensor.tensor_type)
        if widen and blocks.bits == 4:
            blocks = QuantizedWeight(blocks.values, blocks.scales, blocks.mins, 8)
        width = blocks.bits
        chunk = quant_linear.pack(blocks)
        if not packed:  # not joined at the end: that would hold the tensor twice
            packed = [part.new_empty((rows // TILE, *part.shape[1:])) for part in chunk]
        for whole_part, part in zip(packed, chunk, strict=True):
            whole_part[first // TILE:(first + count) // TILE] = part
    weights, scales, mins = packed
    return weights, scales, mins, width


def _save(entry: Path, tensors: dict[str, torch.Tensor], description: dict) -> None:
    """Write the packed tensors and what builds the model at `entry`, whole or not at all."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        torch.save(tensors, tmp / "model.pt")
        (tmp / "model.json").write_text(json.dumps(description))
        os.rename(tmp, entry)
    except OSError:
        if not entry.is_dir():  # not a lost race with another process: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as tmp:
        tmp.write(text)
    os.replace(tmp.name, path)
