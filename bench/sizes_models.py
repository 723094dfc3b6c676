"""The models `bench.sizes` serves: random-weight Llamas of the shapes people deploy, with
SmolLM2's tokenizer, as Q4_K_M GGUFs made by llama.cpp's own quantizer (an F16 GGUF written
first, quantized in llama.cpp's environment, then deleted) and as bf16 safetensors checkpoints.
Each is made once into a folder and reused by later runs.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from gguf import GGMLQuantizationType as Kind

from bench.gguf_shapes import Shape, write_llama_gguf
from bench.launcher import REPO

# Llama-3.2-1B's, Llama-3.2-3B's and Llama-3.1-8B's shapes, and a small one to try the bench on.
SHAPES = {
    "small": Shape(hidden=512, layers=4, heads=8, kv_heads=2, ffn=1536),
    "1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    "3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192),
    "8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, tied=False),
}
FORMATS = ("Q4_K_M", "bf16")


def model_path(folder: Path, shape: str, form: str) -> Path:
    """Where the model of `shape` in `form` is kept: a .gguf file, or a checkpoint folder."""
    return folder / (f"llama-{shape}-{form}.gguf" if form != "bf16" else f"llama-{shape}-bf16")


def make(folder: Path, shape: str, form: str, llamacpp_python: Path) -> Path:
    """The model, made now unless an earlier run left it."""
    path = model_path(folder, shape, form)
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    if form == "bf16":
        return write_bf16_checkpoint(path, SHAPES[shape])
    floats = folder / f"llama-{shape}-F16.gguf"
    write_llama_gguf(floats, SHAPES[shape], Kind.F16)
    partial = path.with_suffix(".partial")
    try:
        done = subprocess.run([str(llamacpp_python), "-m", "bench.sizes_llamacpp", "quantize",
                               str(floats), str(partial), "--ftype", form], cwd=REPO,
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"quantizing {floats} failed:\n{done.stderr[-3000:]}")
        partial.rename(path)
    finally:
        floats.unlink()  # an 8B's is 16 GB
        partial.unlink(missing_ok=True)
    return path


def write_bf16_checkpoint(path: Path, shape: Shape) -> Path:
    """A Hugging Face Llama checkpoint of `shape`: random bf16 weights (spread 0.02, norms
    near 1) in one safetensors file, SmolLM2's tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    from handlers.model_source import default_model_path

    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.context,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=shape.tied,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        torch_dtype="bfloat16")
    generator = torch.Generator().manual_seed(0)

    def weight(rows: int, columns: int) -> torch.Tensor:
        values = torch.randn(rows, columns, generator=generator) * shape.spread
        return values.to(torch.bfloat16)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(shape.hidden, generator=generator)).to(torch.bfloat16)

    head_dim = shape.hidden // shape.heads
    tensors = {"model.embed_tokens.weight": weight(config.vocab_size, shape.hidden),
               "model.norm.weight": norm()}
    for layer in range(shape.layers):
        block = f"model.layers.{layer}."
        tensors |= {
            block + "input_layernorm.weight": norm(),
            block + "post_attention_layernorm.weight": norm(),
            block + "self_attn.q_proj.weight": weight(shape.heads * head_dim, shape.hidden),
            block + "self_attn.k_proj.weight": weight(shape.kv_heads * head_dim, shape.hidden),
            block + "self_attn.v_proj.weight": weight(shape.kv_heads * head_dim, shape.hidden),
            block + "self_attn.o_proj.weight": weight(shape.hidden, shape.heads * head_dim),
            block + "mlp.gate_proj.weight": weight(shape.ffn, shape.hidden),
            block + "mlp.up_proj.weight": weight(shape.ffn, shape.hidden),
            block + "mlp.down_proj.weight": weight(shape.hidden, shape.ffn),
        }
    if not shape.tied:
        tensors["lm_head.weight"] = weight(config.vocab_size, shape.hidden)
    partial = path.with_name(path.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(path)
    return path


def size_gib(path: Path) -> float:
    """A file's size, or the sum of a checkpoint folder's files."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**30
