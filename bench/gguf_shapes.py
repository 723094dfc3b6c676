"""Random-weight GGUFs of a chosen shape, for memory tests and benches: Llama's architecture, or
another whose files gguf_model.py serves from their blocks (`Shape.arch`: Qwen2's q/k/v biases,
Qwen3's q/k norms, Phi-3's joined q/k/v and gate/up), with Llama 3's `rope_freqs` where given.

The blocks are written as gguf's writer takes them (`raw_dtype`): random quantized values and
random float16 scales drawn directly in each block type's layout (Q4_0, Q8_0, and the K-quants
Q4_K and Q6_K that Q4_K_M files hold), or F16 floats for llama.cpp's quantizer (bench.sizes),
sized so a weight's spread is ~0.02 as in trained models; the norms are float32 near 1. The
tokenizer and chat template are the embedded SmolLM2's (copied from its GGUF's metadata), so a
server can take prompts. Tensors are written one at a time:
making a 1B file holds one tensor in memory.

    python -m bench.gguf_shapes OUT.gguf --hidden 2048 --layers 16 --heads 32 --kv-heads 8 \
        --ffn 8192 --kind Q4_0
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Kind
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from handlers.model_source import default_model_path

_WEIGHT_SPREAD = 0.02  # a weight's, as in trained models
# Per block type: weights and bytes of a block, and the byte offsets of its float16 scales with
# the value that gives uniform random bytes elsewhere a weight spread of _WEIGHT_SPREAD (Q4_0:
# d * (q - 8), q's spread 4.6; Q8_0: d * q, 74; Q4_K: d * sc * q - dmin * m, sc ~32 and q 4.6;
# Q6_K: d * sc * (q - 32), |sc| ~64 and q 18).
_LAYOUT = {Kind.Q4_0: (32, 18, {0: _WEIGHT_SPREAD / 4.6}),
           Kind.Q8_0: (32, 34, {0: _WEIGHT_SPREAD / 74}),
           Kind.Q4_K: (256, 144, {0: _WEIGHT_SPREAD / 147, 2: _WEIGHT_SPREAD / 147}),
           Kind.Q6_K: (256, 210, {208: _WEIGHT_SPREAD / 1150})}


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool = True  # the output head is the token embedding (SmolLM2's, Llama-3.2-1B's)
    context: int = 8192
    spread: float = _WEIGHT_SPREAD  # the linears' weights' (wider: a random model's answers vary)
    arch: str = "llama"  # general.architecture: llama, qwen2, qwen3 or phi3
    head_dim: int | None = None  # attention.key_length where not hidden / heads (Qwen3's 128)
    name: str | None = None  # general.name
    window: int | None = None  # attention.sliding_window (Phi-3's files carry one)

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def parameters(self, vocab: int) -> int:
        head_dim = self.dim
        attention = self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads)
        per_layer = attention + 3 * self.hidden * self.ffn + 2 * self.hidden
        heads = 1 if self.tied else 2
        return self.layers * per_layer + heads * vocab * self.hidden + self.hidden


ONE_B = Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192)  # Llama-3.2-1B's shape


def write_llama_gguf(path: Path, shape: Shape, kind: Kind = Kind.Q4_0, seed: int = 0,
                     embedding_kind: Kind | None = None,
                     rope_freqs: np.ndarray | None = None) -> Path:
    """Write a random GGUF of `shape` (its `arch`) at `path`, its linears (an untied head too)
    in `kind` blocks and its token embedding (the head too, where tied) in `embedding_kind`
    (default: `kind`); `rope_freqs`: the frequency factors of Llama 3's rope scaling."""
    tokenizer = GGUFReader(default_model_path())
    vocab = len(tokenizer.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, shape.arch)
    _add_metadata(writer, shape, vocab, tokenizer)
    tensors = _tensor_plan(shape, vocab, kind, embedding_kind or kind)
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = (1, len(rope_freqs), Kind.F32)
    for name, (rows, columns, tensor_kind) in tensors.items():
        nbytes = rows * _row_bytes(columns, tensor_kind)
        if tensor_kind == Kind.F32:  # a norm: one dimension
            writer.add_tensor_info(name, (columns,), np.dtype(np.float32), nbytes)
        elif tensor_kind == Kind.F16:
            writer.add_tensor_info(name, (rows, columns), np.dtype(np.float16), nbytes)
        else:
            writer.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes,
                                   tensor_kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, (rows, columns, tensor_kind) in tensors.items():
        spread = _WEIGHT_SPREAD if name == "token_embd.weight" else shape.spread
        if name == "rope_freqs.weight":
            writer.write_tensor_data(np.asarray(rope_freqs, dtype=np.float32))
        elif name.endswith(".bias"):  # q/k/v biases: as wide as a projection's outputs
            writer.write_tensor_data((0.5 * rng.standard_normal(columns)).astype(np.float32))
        else:
            writer.write_tensor_data(_random_tensor(rng, rows, columns, tensor_kind, spread))
    writer.close()
    return path


def _add_metadata(writer: GGUFWriter, shape: Shape, vocab: int, tokenizer: GGUFReader) -> None:
    writer.add_name(shape.name or f"random-{shape.arch}-{shape.hidden}x{shape.layers}")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(shape.dim)
    if shape.window is not None:
        writer.add_sliding_window(shape.window)
    if shape.head_dim is not None:
        writer.add_key_length(shape.dim)
        writer.add_value_length(shape.dim)
    for key, field in tokenizer.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)


def _tensor_plan(shape: Shape, vocab: int, kind: Kind,
                 embedding_kind: Kind) -> dict[str, tuple[int, int, Kind]]:
    """name: (rows, columns, kind), in the file's order (a float tensor of one row: 1-D)."""
    q, kv, hidden, ffn = shape.heads * shape.dim, shape.kv_heads * shape.dim, shape.hidden, \
        shape.ffn
    plan = {"token_embd.weight": (vocab, hidden, embedding_kind)}
    for layer in range(shape.layers):
        block = f"blk.{layer}."
        plan[block + "attn_norm.weight"] = (1, hidden, Kind.F32)
        if shape.arch == "phi3":  # joined as Phi-3's checkpoints hold them
            plan[block + "attn_qkv.weight"] = (q + 2 * kv, hidden, kind)
        else:
            plan |= {block + "attn_q.weight": (q, hidden, kind),
                     block + "attn_k.weight": (kv, hidden, kind),
                     block + "attn_v.weight": (kv, hidden, kind)}
        if shape.arch == "qwen2":
            plan |= {block + f"attn_{p}.bias": (1, size, Kind.F32)
                     for p, size in (("q", q), ("k", kv), ("v", kv))}
        if shape.arch == "qwen3":
            plan |= {block + f"attn_{p}_norm.weight": (1, shape.dim, Kind.F32) for p in "qk"}
        plan[block + "attn_output.weight"] = (hidden, q, kind)
        plan[block + "ffn_norm.weight"] = (1, hidden, Kind.F32)
        if shape.arch == "phi3":
            plan[block + "ffn_up.weight"] = (2 * ffn, hidden, kind)
        else:
            plan |= {block + "ffn_gate.weight": (ffn, hidden, kind),
                     block + "ffn_up.weight": (ffn, hidden, kind)}
        plan[block + "ffn_down.weight"] = (hidden, ffn, kind)
    plan["output_norm.weight"] = (1, hidden, Kind.F32)
    if not shape.tied:
        plan["output.weight"] = (vocab, hidden, kind)
    return plan


def _row_bytes(columns: int, kind: Kind) -> int:
    if kind in (Kind.F32, Kind.F16):
        return columns * (4 if kind == Kind.F32 else 2)
    weights, size, _ = _LAYOUT[kind]
    return columns // weights * size


def _random_tensor(rng: np.random.Generator, rows: int, columns: int, kind: Kind,
                   spread: float) -> np.ndarray:
    if kind == Kind.F32:  # a norm: [columns], near 1
        return (1 + 0.1 * rng.standard_normal(columns)).astype(np.float32)
    if kind == Kind.F16:  # floats for a quantizer to take (bench.sizes)
        values = rng.standard_normal((rows, columns), dtype=np.float32)
        return (values * spread).astype(np.float16)
    weights, size, scales = _LAYOUT[kind]
    blocks = rng.integers(0, 256, (rows, columns // weights, size), dtype=np.uint8)
    for offset, scale in scales.items():
        d = scale * spread / _WEIGHT_SPREAD * rng.uniform(0.5, 1.5, (*blocks.shape[:2], 1))
        blocks[..., offset:offset + 2] = d.astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    for name, default in (("hidden", 2048), ("layers", 16), ("heads", 32), ("kv-heads", 8),
                          ("ffn", 8192)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--kind", choices=[k.name for k in (*_LAYOUT, Kind.F16)], default="Q4_0")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = Shape(args.hidden, args.layers, args.heads, args.kv_heads, args.ffn)
    write_llama_gguf(args.out, shape, Kind[args.kind], args.seed)
    print(f"{args.out}: {args.out.stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
