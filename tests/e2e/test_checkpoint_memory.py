"""A float checkpoint's start costs the memory its served weights take (issue 50's item 2): real
`lmi-serve` starts on a ~170M-parameter random bf16 Llama checkpoint made here, their peak
resident set (the kernel's VmHWM) above that of the same start on a tiny checkpoint:

- served in bf16: at most 1.1x the files' extra size plus the extra KV cache, plus the packed
  copy of a tied head (onednn_linear.py: the embedding table held twice, which keeps a row's
  logits independent of its batch); the files are read into the served buffers, never mapped
  beside them nor copied to float32;
- quantized to 8 bits as the files are read (option.quantize=int8, what `auto` does on a CPU
  without fast bf16): at most 0.6x.

One greedy answer each, so every weight and the KV cache have been touched; the embedding model
is off and the step eager, as in test_gguf_memory.py."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_process import server_process

from bench.checkpoint_shapes import write_llama_checkpoint
from bench.gguf_shapes import Shape
from bench.start_memory import memory_kib
from handlers.engine.torch.quant_linear import available
from handlers.model_fetch import default_cache_dir

CI_SHAPE = Shape(hidden=1024, layers=8, heads=16, kv_heads=4, ffn=4096)  # 171M parameters
BASELINE_SHAPE = Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)
CONTEXT, SLOTS = 256, 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: write_llama_checkpoint(root / name, shape)
            for name, shape in (("ci", CI_SHAPE), ("baseline", BASELINE_SHAPE))}


def kv_budget(shape: Shape, element: int) -> int:
    """The KV cache's bytes at its fullest: every slot holding the whole context."""
    return shape.layers * 2 * SLOTS * shape.kv_heads * (shape.hidden // shape.heads) \
        * CONTEXT * element


def start_peak(model: Path, tmp: Path, *options: str) -> tuple[int, str]:
    """The server's VmHWM (bytes) after its start on `model` and one greedy answer, and its log
    (the C++ kernels already built: this session's, linked into the empty cache)."""
    cache, log = tmp / f"cache-{model.name}", tmp / f"{model.name}.log"
    cache.mkdir()
    built = default_cache_dir() / "kernels"
    if built.is_dir():
        (cache / "kernels").symlink_to(built, target_is_directory=True)
    with server_process(f"option.model_id={model}", f"option.max_model_len={CONTEXT}",
                        f"option.max_rolling_batch_size={SLOTS}", "option.embedding_model_id=none",
                        "option.enforce_eager=true", *options, log_path=log,
                        env={"LMI_CACHE_DIR": str(cache)}, timeout=900) as (proc, url):
        answer = httpx.post(f"{url}/invocations", timeout=300, json={
            "inputs": "The capital of France is",
            "parameters": {"max_new_tokens": 8, "do_sample": False}})
        assert answer.status_code == 200, answer.text
        peak = memory_kib(proc.pid)["VmHWM"] * 1024
    return peak, log.read_text()


def table_bytes(shape: Shape) -> int:
    """The token embedding's elements (SmolLM2's vocabulary)."""
    return 49152 * shape.hidden


def files_size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


@pytest.mark.parametrize(("options", "ratio", "linears", "kv_bytes"), [
    (("option.dtype=bf16", "option.quantize=none"), 1.1, "float", 2),
    (("option.quantize=int8",), 0.6, "int8", 2),
], ids=["bf16", "int8"])
def test_a_start_peaks_at_the_served_weights_above_a_tiny_models(
        checkpoints: dict[str, Path], tmp_path: Path, options: tuple[str, ...], ratio: float,
        linears: str, kv_bytes: int) -> None:
    if linears == "int8" and not available():
        pytest.skip("no C++ compiler here: the quantized kernel cannot be built")
    peaks = {}
    for name, model in checkpoints.items():
        (tmp_path / name).mkdir()
        peaks[name], log = start_peak(model, tmp_path / name, *options)
        assert f"linear layers {linears}" in log
    extra_files = files_size(checkpoints["ci"]) - files_size(checkpoints["baseline"])
    extra_kv = kv_budget(CI_SHAPE, kv_bytes) - kv_budget(BASELINE_SHAPE, kv_bytes)
    extra_peak = peaks["ci"] - peaks["baseline"]
    # float: the tied head's packed copy of the embedding table (bf16: 2 bytes an element)
    extra_head = 2 * (table_bytes(CI_SHAPE) - table_bytes(BASELINE_SHAPE)) \
        if linears == "float" else 0
    assert extra_peak <= ratio * extra_files + extra_kv + extra_head, (
        f"the 171M model's start peaked {extra_peak / 2**20:.0f} MiB above the tiny one's, for "
        f"{extra_files / 2**20:.0f} MiB more files, {extra_kv / 2**20:.0f} MiB more KV cache "
        f"and {extra_head / 2**20:.0f} MiB of packed head")


def test_auto_reads_16_bit_weights_into_8_bit_blocks_where_the_cpu_computes_in_float32(
        checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The choice `auto` makes, and says, for a bf16 checkpoint: the log names the float dtype
    this CPU computes in, and the weights follow it (bf16 kept, or 8-bit blocks; never a float32
    copy of bf16 files)."""
    _, log = start_peak(checkpoints["baseline"], tmp_path)
    dtype_line = next(line for line in log.splitlines() if "option.quantize=auto" in line)
    if "weights would be copied to float32" in dtype_line:
        assert "Weights of baseline: linear layers int8" in log
    else:
        assert "keeps its float weights" in dtype_line
        assert "Weights of baseline: linear layers float" in log
    assert "float32" not in log.split("Weights of baseline:")[1].splitlines()[0]
