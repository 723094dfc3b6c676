"""A Llama GGUF served from its own blocks (handlers/engine/torch/gguf_model.py): the greedy
answers the dequantizing path gave (recorded in tests/golden/gguf_greedy.json by
tests/gguf_greedy.py before that path stopped serving these files), no float copy in the cache,
a warm start that does not read the GGUF again, and what it does not serve left to the old path."""

from __future__ import annotations

import json
from pathlib import Path

import gguf_greedy
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Kind
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from bench.gguf_shapes import Shape, write_llama_gguf
from handlers.engine.torch import gguf_model
from handlers.engine.torch.gguf_blocks import to_blocks, unpermuted
from handlers.engine.torch.loader import load_model
from handlers.engine.torch.quant_linear import QuantEmbedding, QuantLinear, available
from handlers.model_source import default_model_path

pytestmark = pytest.mark.skipif(not available(), reason="no C++ compiler here")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def random_gguf(cache: Path) -> Path:
    return gguf_greedy.test_model(cache.parent)


@pytest.mark.parametrize("model", ["embedded", "random"])
def test_greedy_answers_are_the_dequantized_paths(model, cache, random_gguf):
    path = default_model_path() if model == "embedded" else random_gguf
    loaded = load_model(path, dtype="fp32", cache_dir=cache, quantize="gguf")
    assert isinstance(loaded.model.model.embed_tokens, QuantEmbedding)
    assert isinstance(loaded.model.lm_head, QuantLinear)
    assert (loaded.quantize_mode, loaded.quantize) == ("gguf", "int4")
    golden = json.loads(gguf_greedy.GOLDEN.read_text())[model]
    assert gguf_greedy.greedy(loaded) == golden


def test_the_cache_holds_the_blocks_and_no_float_copy(tmp_path, random_gguf):
    cache = tmp_path / "cache"
    load_model(random_gguf, dtype="fp32", cache_dir=cache, quantize="gguf")
    assert not (cache / "gguf").exists()  # the dequantizing path's float checkpoint
    (entry,) = (cache / "gguf-packed").iterdir()
    tensors = torch.load(entry / "model.pt", mmap=True, weights_only=True)
    floats = {name: t for name, t in tensors.items() if t.is_floating_point()
              and t.dtype != torch.float16}
    assert floats and all(name.endswith("norm.weight") and t.dim() == 1
                          for name, t in floats.items())
    cached = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    # The packed blocks (a float16 scale and min per 32 weights) and the tokenizer's files.
    assert cached <= 1.25 * random_gguf.stat().st_size + (4 << 20)


def test_a_warm_start_maps_the_cache_without_reading_the_gguf(cache, random_gguf, monkeypatch):
    load_model(random_gguf, dtype="fp32", cache_dir=cache, quantize="gguf")

    def unread(*args, **kwargs):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(gguf_model, "GGUFReader", unread)
    loaded = load_model(random_gguf, dtype="fp32", cache_dir=cache, quantize="gguf")
    assert isinstance(loaded.model.lm_head, QuantLinear)


def test_int8_widens_the_4_bit_blocks(cache, random_gguf):
    loaded = load_model(random_gguf, dtype="fp32", cache_dir=cache, quantize="int8")
    widths = {m.bits for m in loaded.model.modules() if isinstance(m, QuantLinear)}
    assert widths == {8} and loaded.quantize == "int8"


def test_a_bfloat16_model_embeds_in_bfloat16(cache, random_gguf):
    loaded = load_model(random_gguf, dtype="bf16", cache_dir=cache, quantize="gguf")
    assert loaded.dtype == torch.bfloat16
    assert loaded.model.model.embed_tokens(torch.tensor([[3]])).dtype == torch.bfloat16


def test_what_it_does_not_build_is_refused_and_remembered(tmp_path):
    path = write_llama_gguf(tmp_path / "biased.gguf", Shape(64, 1, 4, 2, 128, tied=False))
    with_bias = tmp_path / "with-bias.gguf"
    _add_tensor(path, with_bias, "blk.0.attn_q.bias", np.zeros(64, np.float32))
    with pytest.raises(gguf_model.Unsupported, match="blk.0.attn_q.bias"):
        gguf_model.load(with_bias, "gguf", torch.float32, tmp_path / "cache")
    (verdict,) = (tmp_path / "cache" / "gguf-packed").glob("*.unsupported")
    assert "blk.0.attn_q.bias" in verdict.read_text()


def _add_tensor(source: Path, target: Path, name: str, values: np.ndarray) -> None:
    """`source` rewritten at `target` with one more float tensor."""
    reader = GGUFReader(source)
    writer = GGUFWriter(target, "llama")
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        sub_type = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_k_quants_are_the_blocks_the_dequantizing_path_quantized(tmp_path, caplog):
    """A Q4_K_M-like file (Q4_K linears, a Q6_K embedding and tied head): each linear holds the
    blocks gguf_blocks.py made of it for the path that dequantizes (Q4_K as eight 4-bit blocks,
    Q6_K quantized again to 8 bits), and the log says which types were quantized again."""
    path = write_llama_gguf(tmp_path / "k.gguf", Shape(256, 2, 4, 2, 512), Kind.Q4_K,
                            embedding_kind=Kind.Q6_K)
    with caplog.at_level("INFO"):
        model = gguf_model.load(path, "gguf", torch.float32, tmp_path / "cache")
    assert "Q6_K as int8: quantized again to 8 bits" in caplog.text
    raw = {t.name: t for t in GGUFReader(path).tensors}
    heads = model.config.num_attention_heads

    def blocks_of(name: str, rows: torch.Tensor | None = None) -> torch.Tensor:
        tensor = raw[name]
        data = np.asarray(tensor.data)
        if rows is not None:
            data = data[rows.numpy()]
        return to_blocks(data, tensor.tensor_type).dequantize()

    q_rows = unpermuted(256, heads)
    layer = model.model.layers[0]
    qkv = layer.self_attn.q_proj.shared.fused.unpacked().dequantize()  # joined as served
    assert torch.equal(qkv[:256], blocks_of("blk.0.attn_q.weight", q_rows))
    assert torch.equal(layer.mlp.down_proj.unpacked().dequantize(),
                       blocks_of("blk.0.ffn_down.weight"))
    table = blocks_of("token_embd.weight")
    assert torch.equal(model.lm_head.unpacked().dequantize(), table)
    ids = torch.tensor([0, 5, 49151])
    assert torch.equal(model.model.embed_tokens(ids), table[ids])
