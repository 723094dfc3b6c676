"""Random-weight Llama checkpoints (config.json and safetensors shards, as Hugging Face publishes
them) of a chosen shape, for memory tests and benches: the float twin of gguf_shapes.py, with
the same `Shape`s and the embedded SmolLM2's tokenizer and chat template.

Shards of a few layers each are written one at a time, so making an 8B checkpoint holds one
shard in memory, not the model.

    python -m bench.checkpoint_shapes OUT_DIR --hidden 2048 --layers 16 --heads 32 \
        --kv-heads 8 --ffn 8192 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from gguf import GGUFReader
from safetensors.torch import save_file

from bench.gguf_shapes import Shape
from handlers.engine.gguf.cache import tokenizer_dir
from handlers.model_source import default_model_path

_SHARD_BYTES = 1 << 30


def write_llama_checkpoint(directory: Path, shape: Shape, dtype: torch.dtype = torch.bfloat16,
                           seed: int = 0) -> Path:
    """Write a random Llama checkpoint of `shape` in `dtype` into `directory`; return it."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer_dir(default_model_path())
    for file in tokenizer.iterdir():
        if file.is_file() and file.name != "config.json":
            (directory / file.name).write_bytes(file.read_bytes())
    metadata = GGUFReader(default_model_path())
    vocab = len(metadata.fields["tokenizer.ggml.tokens"].data)
    eos = int(metadata.get_field("tokenizer.ggml.eos_token_id").contents())
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    for name, size in _tensors(shape, vocab):
        if name.endswith("norm.weight"):
            tensor = torch.ones(size, dtype=dtype)
        else:
            tensor = (torch.randn(size, generator=generator) * shape.spread).to(dtype)
        shard[name] = tensor
        if sum(t.numel() * t.element_size() for t in shard.values()) >= _SHARD_BYTES:
            _save(directory, shard, weight_map)
    if shard:
        _save(directory, shard, weight_map)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(_config(shape, vocab, dtype, eos)))
    return directory


def _tensors(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    head_dim = shape.hidden // shape.heads
    tensors = [("model.embed_tokens.weight", (vocab, shape.hidden))]
    for layer in range(shape.layers):
        prefix = f"model.layers.{layer}."
        tensors += [
            (prefix + "input_layernorm.weight", (shape.hidden,)),
            (prefix + "self_attn.q_proj.weight", (shape.heads * head_dim, shape.hidden)),
            (prefix + "self_attn.k_proj.weight", (shape.kv_heads * head_dim, shape.hidden)),
            (prefix + "self_attn.v_proj.weight", (shape.kv_heads * head_dim, shape.hidden)),
            (prefix + "self_attn.o_proj.weight", (shape.hidden, shape.heads * head_dim)),
            (prefix + "post_attention_layernorm.weight", (shape.hidden,)),
            (prefix + "mlp.gate_proj.weight", (shape.ffn, shape.hidden)),
            (prefix + "mlp.up_proj.weight", (shape.ffn, shape.hidden)),
            (prefix + "mlp.down_proj.weight", (shape.hidden, shape.ffn)),
        ]
    tensors.append(("model.norm.weight", (shape.hidden,)))
    if not shape.tied:
        tensors.append(("lm_head.weight", (vocab, shape.hidden)))
    return tensors


def _save(directory: Path, shard: dict[str, torch.Tensor], weight_map: dict[str, str]) -> None:
    name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
    save_file(shard, directory / name, metadata={"format": "pt"})
    weight_map |= dict.fromkeys(shard, name)
    shard.clear()


def _config(shape: Shape, vocab: int, dtype: torch.dtype, eos: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": shape.hidden, "intermediate_size": shape.ffn,
            "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "vocab_size": vocab, "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": shape.tied,
            "max_position_embeddings": shape.context,
            "dtype": str(dtype).removeprefix("torch."),
            "eos_token_id": eos}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    for size in ("hidden", "layers", "heads", "kv-heads", "ffn"):
        parser.add_argument(f"--{size}", type=int, required=True)
    parser.add_argument("--untied", action="store_true")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = parser.parse_args(argv)
    shape = Shape(hidden=args.hidden, layers=args.layers, heads=args.heads,
                  kv_heads=args.kv_heads, ffn=args.ffn, tied=not args.untied)
    write_llama_checkpoint(args.out, shape, getattr(torch, args.dtype))
    print(args.out)


if __name__ == "__main__":
    main()
