"""The models `bench.sizes` serves: random-weight Llamas of the shapes people deploy, with
SmolLM2's tokenizer, as Q4_K_M GGUFs made by llama.cpp's own quantizer (an F16 GGUF written
first, quantized in llama.cpp's environment, then deleted) and as bf16 safetensors checkpoints.
Each is made once into a folder and reused by later runs.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from gguf import GGMLQuantizationType as Kind

from bench.checkpoint_shapes import write_llama_checkpoint
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
        return write_llama_checkpoint(path, SHAPES[shape])
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
