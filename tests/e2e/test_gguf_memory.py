"""A GGUF's first start costs the memory its blocks take (issue 50's check): a real `lmi-serve`
start on a ~300M-parameter random Llama GGUF made here (Q4_0 linears, a Q8_0 embedding and
tied head, written with gguf's writer), its peak resident set (the kernel's VmHWM) above that of
the same start on a tiny GGUF at most 1.3x the file's extra size plus the extra KV cache, and
nothing like a float copy of the model in its cache directory.

Both starts run with the defaults a user gets (option.quantize=auto), one greedy answer each so
every weight and the KV cache have been touched; the embedding model is off (it would load after
the start, beside what is measured) and the step runs eagerly (the compiled graphs are
a copy of their own, issue 50's item 4)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from gguf import GGMLQuantizationType as Kind
from server_process import server_process

from bench.gguf_shapes import Shape, write_llama_gguf
from bench.start_memory import memory_kib
from handlers.engine.torch.quant_linear import available
from handlers.model_fetch import default_cache_dir

pytestmark = pytest.mark.skipif(not available(), reason="no C++ compiler here")

CI_SHAPE = Shape(hidden=1024, layers=16, heads=16, kv_heads=4, ffn=4096)  # 293M parameters
BASELINE_SHAPE = Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)
CONTEXT, SLOTS = 256, 4


def kv_budget(shape: Shape) -> int:
    """The float32 KV cache's bytes at its fullest: every slot holding the whole context."""
    head_dim = shape.hidden // shape.heads
    return shape.layers * 2 * SLOTS * shape.kv_heads * head_dim * CONTEXT * 4


def first_start_peak(model: Path, cache: Path, log: Path) -> int:
    """The server's VmHWM (bytes) after its first start on `model` and one greedy answer (the C++
    kernels already built: this session's, linked into the empty cache)."""
    built = default_cache_dir() / "kernels"
    cache.mkdir()
    if built.is_dir():
        (cache / "kernels").symlink_to(built, target_is_directory=True)
    options = (f"option.model_id={model}", f"option.max_model_len={CONTEXT}",
               f"option.max_rolling_batch_size={SLOTS}", "option.embedding_model_id=none",
               "option.enforce_eager=true")
    with server_process(*options, log_path=log, env={"LMI_CACHE_DIR": str(cache)},
                        timeout=900) as (proc, url):
        answer = httpx.post(f"{url}/invocations", timeout=300, json={
            "inputs": "The capital of France is",
            "parameters": {"max_new_tokens": 8, "do_sample": False}})
        assert answer.status_code == 200, answer.text
        peak = memory_kib(proc.pid)["VmHWM"] * 1024
    assert "served from its blocks" in log.read_text()
    return peak


def test_a_first_start_peaks_at_the_blocks_and_kv_cache_above_a_tiny_models(tmp_path):
    models = {name: write_llama_gguf(tmp_path / f"{name}.gguf", shape, Kind.Q4_0,
                                     embedding_kind=Kind.Q8_0)
              for name, shape in (("ci", CI_SHAPE), ("baseline", BASELINE_SHAPE))}
    peaks = {name: first_start_peak(path, tmp_path / f"cache-{name}", tmp_path / f"{name}.log")
             for name, path in models.items()}
    extra_file = models["ci"].stat().st_size - models["baseline"].stat().st_size
    extra_kv = kv_budget(CI_SHAPE) - kv_budget(BASELINE_SHAPE)
    extra_peak = peaks["ci"] - peaks["baseline"]
    assert extra_peak <= 1.3 * extra_file + extra_kv, (
        f"the 293M model's start peaked {extra_peak / 2**20:.0f} MiB above the tiny one's, for "
        f"{extra_file / 2**20:.0f} MiB more file and {extra_kv / 2**20:.0f} MiB more KV cache")
    cached = sum(f.stat().st_size for name in ("gguf-packed", "gguf-tokenizer", "hashes")
                 for f in (tmp_path / "cache-ci" / name).rglob("*") if f.is_file())
    # The packed blocks (a float16 scale and min per 32 weights: Q4_0's 18 bytes become 20) and
    # the tokenizer's files; a float copy would be 7x the file.
    assert cached <= 1.2 * models["ci"].stat().st_size + (8 << 20)
    assert not (tmp_path / "cache-ci" / "gguf").exists()  # where a float checkpoint would go
