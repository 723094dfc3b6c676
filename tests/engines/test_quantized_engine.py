"""The torch engine on quantized linears (option.quantize): a tiny Llama checkpoint quantized at
load to 8 and 4 bits keeps the engine's guarantee that a seeded request's tokens do not depend on
the rest of its batch; the embedded model served from its GGUF blocks (what `auto` serves) keeps
its perplexity within what issue 35 allows; bad values are refused by name."""

from __future__ import annotations

import asyncio

import pytest
import test_torch_engine
import torch
from engine_requests import run
from tiny_model import make_tiny_model_dir

from bench import accuracy
from bench.prompts import QUESTIONS, chat_prompt
from handlers.config import ConfigError, load_config, parse_args
from handlers.engine import registry
from handlers.engine.torch.engine import TorchEngine
from handlers.engine.torch.loader import load_model
from handlers.engine.torch.quant_linear import QuantEmbedding, QuantLinear, available
from handlers.model_source import default_model_path

pytestmark = pytest.mark.skipif(not available(), reason="no C++ compiler here")
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Deep learning is",
           "Once upon a time, in a land far away, there lived a dragon who loved to read."]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("mode", ["int8", "int4"])
async def test_seeded_tokens_do_not_depend_on_the_batch_on_quantized_linears(tiny_dir, mode):
    loaded = load_model(tiny_dir, dtype="fp32", quantize=mode)
    layers = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    # 2 layers' 4 (q/k/v and gate/up read joined), and the head over the 8-bit embedding's blocks
    assert loaded.quantize == mode and len(layers) == 2 * 4 + 1
    assert isinstance(loaded.model.model.embed_tokens, QuantEmbedding)
    engine = TorchEngine(loaded, max_batch_size=8)
    await engine.start()
    try:
        await test_torch_engine.test_seed_gives_same_text_whatever_the_batch(engine)
        [greedy_alone] = await run(engine, PROMPTS[2], max_new_tokens=12, ignore_eos=True)
        batch = await asyncio.gather(*(run(engine, p, max_new_tokens=12, ignore_eos=True)
                                       for p in PROMPTS))
        assert batch[2][0]["ids"] == greedy_alone["ids"]
    finally:
        await engine.shutdown()


def test_unknown_or_vllm_only_quantizations_are_refused_by_the_torch_engine(tiny_dir):
    for value in ("awq", "int3"):
        argv = ["--model-dir", str(tiny_dir), "--option", "option.rolling_batch=torch",
                "--option", f"option.quantize={value}"]
        with pytest.raises(ConfigError, match=f"option.quantize={value} \\(command line\\) is not "
                                              "supported by the torch engine, which takes auto"):
            registry.check(load_config(parse_args(argv), env={}))
    with pytest.raises(ValueError, match="option.quantize 'awq': the torch engine takes"):
        load_model(tiny_dir, quantize="awq")


@pytest.mark.slow
async def test_on_the_gguf_blocks_a_greedy_answer_ignores_its_batch():
    """The embedded model on its Q4_1/Q8_0 blocks (what `auto` serves where its startup probe
    finds the kernel faster; forced here, as a busy machine's probe may find it slower:
    test_auto_measures_the_cpus_float_dtype_once tests that choice): 32 greedy answers decoded
    together, arriving one after another, equal each alone."""
    loaded = load_model(default_model_path(), quantize="gguf")
    assert (loaded.quantize_mode, loaded.quantize) == ("gguf", "int4")
    engine = TorchEngine(loaded, max_batch_size=32, max_prefill_tokens=512)
    await engine.start()
    try:
        prompts = [chat_prompt(question) for question in QUESTIONS]
        alone = [(await run(engine, p, max_new_tokens=24))[0]["ids"] for p in prompts[:8]]

        async def arriving(index: int, prompt: str):
            await asyncio.sleep(index * 0.05)
            return (await run(engine, prompt, max_new_tokens=24))[0]["ids"]

        together = await asyncio.gather(*(arriving(i, p) for i, p in enumerate(prompts)))
        assert together[:8] == alone
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("serves", ["float32", "bfloat16"])
def test_auto_measures_the_cpus_float_dtype_once(monkeypatch, serves):
    """A GGUF under option.quantize=auto and option.dtype=auto: the quantization probe measures
    which float dtype this CPU serves in, and the loader takes its answer rather than measuring
    again; where the blocks lose to it, the model is served in that dtype."""
    from handlers.engine.torch import loader, quantization

    probed = getattr(torch, serves)
    measured = []
    monkeypatch.setattr(quantization, "choose_cpu_dtype",
                        lambda: measured.append(1) or (probed, "measured"))
    monkeypatch.setattr(loader, "choose_cpu_dtype", lambda: pytest.fail("measured twice"))
    monkeypatch.setattr(quantization, "alternating_best",
                        lambda calls, rounds, repeats: {k: (c(), 1.0)[1] for k, c in calls.items()})
    loaded = load_model(default_model_path())  # a tie: the blocks win, and serve float32 in
    assert (loaded.quantize_mode, loaded.dtype, measured) == ("gguf", torch.float32, [1])
    # the kernel twice as slow as the float matmul: none
    monkeypatch.setattr(quantization, "alternating_best",
                        lambda calls, rounds, repeats: {"kernel": 2.0, "float": 1.0})
    loaded = load_model(default_model_path())
    assert (loaded.quantize_mode, loaded.dtype, measured) == ("none", probed, [1, 1])


@pytest.mark.slow
def test_the_quantized_paths_keep_the_embedded_models_perplexity():
    """int8 within 1% of float32, the GGUF's 4-bit blocks and 4 bits at load within 2% of the
    GGUF's own perplexity (its blocks dequantized: the float model here); float32 against
    itself agrees in every answer (the reference is deterministic)."""
    results = accuracy.measure(tokens=64, window=512, variants=["int8", "int4", "gguf"])
    base = results["float32"]["perplexity"]
    assert results["float32"]["identical"] == 1.0
    assert results["int8"]["perplexity"] <= base * 1.01
    assert results["gguf"]["perplexity"] <= base * 1.02
    assert results["int4"]["perplexity"] <= base * 1.02
    assert results["gguf"]["linears"] == "int4" and results["int8"]["linears"] == "int8"
