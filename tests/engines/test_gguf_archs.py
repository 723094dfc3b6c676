"""GGUFs of the architectures people download, served from their own blocks
(handlers/engine/torch/gguf_model.py): Qwen2 (q/k/v biases), Qwen3 (q/k norms), Phi-3 (q/k/v
and gate/up joined in the file), Llama 3 (`rope_freqs`) and Mistral (a llama file). Each is a
tiny random model written here (bench/gguf_shapes.py: random Q4_0 blocks, a Q8_0 embedding,
SmolLM2's tokenizer), compared with what the dequantizing path gives the same
file (handlers/engine/gguf/cache.py: transformers' own model class on the dequantized weights):

- the same model: its blocks dequantized into float linears, the served model's logits are the
  dequantizing path's (the mapping of every tensor, q/k order, biases, norms, rope checked);
- the same greedy tokens, with the kernel on both sides: transformers' forward with its linears
  over the same blocks and its norms computed by the kernel's op, as the served stack computes
  them (their logits are then bit for bit the served model's). The kernel quantizes each input
  row to int8 (quant_linear.py): against float linears this random model's logits move by up
  to ~0.5 (measured; the llama route's by as much), and with transformers' own norms, whose
  last bits differ, by up to ~0.07, so greedy tokens part where the top two logits are that
  close (measured: ~0.01 apart where a Qwen2 prompt parted);
- no float copy in the cache, and a real server answering a chat.
"""

from __future__ import annotations

import copy
from pathlib import Path

import gguf_greedy
import httpx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Kind
from gguf import GGUFReader
from server_process import server_process
from torch import nn

from bench.gguf_shapes import Shape, write_llama_gguf
from handlers.engine.loop.runner import PrefillChunk
from handlers.engine.torch import gguf_model, quant_linear
from handlers.engine.torch.decode_graphs import DecodeGraphs
from handlers.engine.torch.fused_projections import ProjectionPart
from handlers.engine.torch.loader import LoadedModel, load_model
from handlers.engine.torch.model_runner import ModelRunner
from handlers.engine.torch.quant_linear import TILE, QuantEmbedding, QuantLinear, available
from handlers.model_fetch import default_cache_dir

pytestmark = pytest.mark.skipif(not available(), reason="no C++ compiler here")

_BASE = {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "ffn": 768, "tied": False,
         "spread": 0.08}
SHAPES = {
    "qwen2": Shape(**_BASE, arch="qwen2"),
    # transformers reads no head size from a qwen3 GGUF: its default (128), as Qwen3's files have
    "qwen3": Shape(**_BASE | {"heads": 4, "kv_heads": 2}, arch="qwen3", head_dim=128),
    "phi3": Shape(**_BASE, arch="phi3"),
    "llama3": Shape(**_BASE),  # with rope_freqs (LLAMA3_ROPE)
    # Mistral's files are llama's (named as its converter names them); its head tied here
    "mistral": Shape(**_BASE | {"tied": True}, name="Mistral 7B Instruct v0.3"),
}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 100000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
PROMPT = "What is the capital of France? Write a haiku about the sea. List three primes: 2, 3"


def llama3_factors(head_dim: int) -> np.ndarray:
    """What llama.cpp's converter writes as `rope_freqs` for LLAMA3_ROPE: each frequency's
    divisor, from transformers' own Llama 3 frequencies."""
    rotary = _llama3_rotary(head_dim)
    theta = LLAMA3_ROPE["rope_theta"]
    default = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    return (default / rotary.inv_freq).numpy()


def _llama3_rotary(head_dim: int) -> nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=head_dim, num_attention_heads=1,
                         max_position_embeddings=16384, rope_parameters=LLAMA3_ROPE)
    return LlamaRotaryEmbedding(config)


class Arch:
    """One architecture's file, served from its blocks and through the dequantizing path."""

    def __init__(self, name: str, directory: Path) -> None:
        self.name, self.cache = name, directory / "cache"
        self.dequantized_cache = directory / "dequantized"  # the float copy: not in `cache`
        shape = SHAPES[name]
        factors = llama3_factors(shape.dim) if name == "llama3" else None
        self.path = write_llama_gguf(directory / f"random-{name}.gguf", shape, Kind.Q4_0, seed=7,
                                     embedding_kind=Kind.Q8_0, rope_freqs=factors)
        self.served = load_model(self.path, dtype="fp32", cache_dir=self.cache, quantize="gguf")

    def dequantized(self) -> LoadedModel:
        """transformers' model of the file on its dequantized weights (float linears), with the
        rope the file asks for: the dequantizing path reads no `rope_freqs` (Llama 3's), so its
        model gets the Llama 3 rope of the checkpoint the file was converted from."""
        loaded = load_model(self.path, dtype="fp32", cache_dir=self.dequantized_cache,
                            quantize="none")
        if self.name == "llama3":
            loaded.model.model.rotary_emb = _llama3_rotary(SHAPES[self.name].dim)
        return loaded


@pytest.fixture(scope="module", params=list(SHAPES))
def arch(request, tmp_path_factory) -> Arch:
    return Arch(request.param, tmp_path_factory.mktemp(request.param))


def test_it_is_served_from_its_blocks_with_no_float_copy(arch):
    served = arch.served
    assert type(served.model).__name__ == "LlamaCausalLM"  # the stack and the decode graphs
    assert isinstance(served.model.model.embed_tokens, QuantEmbedding)
    assert isinstance(served.model.lm_head, QuantLinear)
    assert served.quantization == "gguf (int4)"
    assert not (arch.cache / "gguf").exists()  # where the float checkpoint would go
    (entry,) = (arch.cache / "gguf-packed").iterdir()
    floats = [t for t in torch.load(entry / "model.pt", mmap=True, weights_only=True).values()
              if t.dtype == torch.float32]
    assert all(t.dim() == 1 for t in floats)  # norms, biases, rope factors: no float matrix


def test_its_blocks_dequantized_are_the_dequantizing_paths_model(arch):
    reference = arch.dequantized()
    assert type(reference.model).__name__ != "LlamaCausalLM"  # transformers' class for the file
    ids = reference.tokenizer.encode(PROMPT)
    served = _float_linears(copy.deepcopy(arch.served.model))
    expected = _logits(reference.model, ids)
    torch.testing.assert_close(_logits(served, ids), expected, rtol=1e-4, atol=1e-4)
    if arch.name == "llama3":  # the file's rope factors matter: without them, other logits
        plain = load_model(arch.path, dtype="fp32", cache_dir=arch.dequantized_cache,
                           quantize="none")
        assert not torch.allclose(_logits(plain.model, ids), expected, rtol=1e-4, atol=1e-4)


def test_greedy_tokens_are_the_dequantizing_paths_over_the_same_blocks(arch):
    reference = arch.dequantized()
    _kernel_linears(reference.model, arch.served.model)
    _kernel_norms(reference.model)
    assert gguf_greedy.greedy(arch.served) == gguf_greedy.greedy(reference)


@pytest.mark.slow
def test_the_compiled_decode_step_gives_the_eager_steps_logits(arch, tmp_path):
    """The ops the Llama stack gained (Qwen2's biases, Qwen3's q/k norms) compiled: a few
    minutes each, so for those two; the others compile what a llama file's step compiles."""
    if arch.name not in ("qwen2", "qwen3"):
        pytest.skip("its step is a llama file's (tests/engines/test_decode_graphs.py)")
    slots, length = 4, 256
    graphs = DecodeGraphs.for_model(arch.served, slots, length, tmp_path)
    graphs.start()
    assert graphs.ready.wait(1800) and graphs.counts()["decode_graphs_ready"] == 1
    fast = ModelRunner(arch.served.model, slots, length, graphs, kv_dtype=graphs.kv_dtype)
    eager = ModelRunner(load_model(arch.path, dtype="fp32", cache_dir=arch.cache,
                                   quantize="gguf").model, slots, length,
                        kv_dtype=graphs.kv_dtype)
    prompts = [list(range(5 + row, 20 + 7 * row)) for row in range(slots)]
    for runner in (fast, eager):
        runner.prefill([PrefillChunk(slot, ids, 0) for slot, ids in enumerate(prompts)])
    token, position = prompts[0][-1], len(prompts[0])
    for _ in range(10):
        alone = fast.decode([token], [position])[0]
        assert torch.equal(alone, eager.decode([token], [position])[0])
        crowd = fast.decode([token] + [p[-1] for p in prompts[1:]],
                            [position] + [len(p) for p in prompts[1:]])[0]
        assert torch.equal(crowd, alone)
        token, position = int(alone.argmax()), position + 1


def test_a_server_answers_a_chat(arch, tmp_path):
    log = tmp_path / "server.log"
    built = default_cache_dir() / "kernels"  # the C++ kernels this session built already
    if built.is_dir() and not (arch.cache / "kernels").exists():
        (arch.cache / "kernels").symlink_to(built, target_is_directory=True)
    options = (f"option.model_id={arch.path}", "option.rolling_batch=torch",
               "option.max_model_len=256", "option.embedding_model_id=none")
    with server_process(*options, log_path=log, env={"LMI_CACHE_DIR": str(arch.cache)},
                        timeout=300) as (_, url):
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8, "temperature": 0})
    assert chat.status_code == 200, chat.text
    answer = chat.json()["choices"][0]
    assert answer["message"]["content"] and answer["finish_reason"] == "length"
    assert "served from its blocks" in log.read_text()


def test_an_architecture_it_does_not_build_is_refused_with_its_reason(tmp_path):
    path = write_llama_gguf(tmp_path / "gemma2.gguf", Shape(**_BASE, arch="gemma2"))
    with pytest.raises(gguf_model.Unsupported, match="architecture 'gemma2'"):
        gguf_model.load(path, "gguf", torch.float32, tmp_path / "cache")


class _KernelNorm(nn.Module):
    """An RMSNorm computed by the quantized linears' op, as the served stack computes it over
    quantized linears (llama_stack.py: `exact_norms`)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear.rms_norm(x, self)


def _kernel_norms(model: nn.Module) -> None:
    for name in [n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]:
        model.set_submodule(name, _KernelNorm(model.get_submodule(name)))


def test_a_sliding_window_bounds_the_context(tmp_path):
    """Phi-3's files carry the window its attention was trained with; the served model attends
    every key, which is the same within the window only."""
    shape = Shape(**_BASE | {"context": 4096}, arch="phi3", window=2047)
    reader = GGUFReader(write_llama_gguf(tmp_path / "phi3.gguf", shape))
    settings = gguf_model.settings_of(reader, {t.name: t for t in reader.tensors})
    assert settings.max_position_embeddings == 2047


def _logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """Every position's logits of `ids`, through the engine's runner."""
    runner = ModelRunner(model, num_slots=1, max_len=256)
    return runner.prefill([PrefillChunk(slot=0, token_ids=ids, start=0, all_logits=True)])[0]


def _float_linears(model: nn.Module) -> nn.Module:
    """`model` with each quantized linear a float one over its blocks' values and its bias."""
    for name, layer in [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]:
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        linear.weight = nn.Parameter(layer.unpacked().dequantize())
        if layer.bias is not None:
            linear.bias = nn.Parameter(layer.bias)
        model.set_submodule(name, linear)
    return model


def _kernel_linears(reference: nn.Module, served: nn.Module) -> None:
    """Each of `reference`'s (transformers') linears replaced by a quantized one over the served
    model's blocks for the same rows (the served model joins q/k/v and gate/up)."""
    for name in [n for n, m in reference.named_modules() if type(m) is nn.Linear]:
        parent, _, leaf = name.rpartition(".")
        joined = {"qkv_proj": "q_proj", "gate_up_proj": "gate_proj"}.get(leaf)  # Phi-3's
        source = served.get_submodule(f"{parent}.{joined}" if joined else name)
        start, size = 0, None
        if isinstance(source, ProjectionPart):
            sizes = source.shared.sizes
            if not joined:
                start, size = sum(sizes[: source.index]), sizes[source.index]
            source = source.shared.fused
        end = start + (size or source.out_features)
        tiles = slice(start // TILE, end // TILE)
        bias = None if source.bias is None else source.bias[start:end]
        reference.set_submodule(name, QuantLinear.packed(
            source.weights[tiles], source.scales[tiles], source.mins[tiles], source.bits, bias))
