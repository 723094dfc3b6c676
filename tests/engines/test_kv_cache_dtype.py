"""option.kv_cache_dtype on the torch engine: the slot cache stores what it asks (16 bits by
default, 8 when asked), in that much memory, and a sequence's answer still does not depend on
the rest of its batch, over a tiny random-weight Llama (tests/tiny_model.py)."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from engine_requests import collect, random_schedule, token_request
from tiny_model import make_tiny_model_dir

from bench import accuracy
from handlers.engine.loop.direct import DirectStepper
from handlers.engine.torch.engine import TorchEngine
from handlers.engine.torch.loader import load_model

# The tiny model's keys and values per token: 2 layers x 2 KV heads x 16 elements, twice.
ELEMENTS_PER_TOKEN = 2 * 2 * 2 * 16
TEXT = ("The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, "
        "there lived a dragon who loved to read books about the history of mathematics.")


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("bf16")), dtype="bf16")


@pytest.mark.parametrize(("option", "dtype"), [
    ("auto", torch.float16),  # a float32 model: 16 bits
    ("float32", torch.float32),
    ("float16", torch.float16),
    ("bfloat16", torch.bfloat16),
    ("fp8", torch.float8_e4m3fn),
    ("fp8_e4m3", torch.float8_e4m3fn),
    ("fp8_e5m2", torch.float8_e5m2),
])
def test_the_cache_holds_the_dtype_asked_in_the_memory_it_takes(loaded, option, dtype):
    """Every buffer the engine's cache holds is of the dtype, its bytes per token (what the
    prefix cache's budget is divided by) the dtype's size, and a budget holds as many more
    tokens as the dtype is smaller."""
    engine = TorchEngine(loaded, max_batch_size=4, prefix_cache_bytes=64 << 10,
                         kv_cache_dtype=option)
    stepped = DirectStepper(engine)
    stepped.add(token_request(loaded.tokenizer.encode(TEXT, add_special_tokens=False), 4))
    while stepped.has_work:
        stepped.step()
    cache = engine.batcher.runner.cache
    assert {b.dtype for b in cache.keys + cache.values} == {dtype}
    assert engine.kv_cache_dtype == str(dtype).removeprefix("torch.")
    size = torch.tensor([], dtype=dtype).element_size()
    assert cache.bytes_per_token == ELEMENTS_PER_TOKEN * size
    held = sum(b.untyped_storage().nbytes() for b in cache.keys + cache.values)
    assert held == 4 * cache.capacity * ELEMENTS_PER_TOKEN * size
    assert engine.batcher.prefix.max_tokens == (64 << 10) // (ELEMENTS_PER_TOKEN * size)


def test_auto_is_16_bits_and_says_why(loaded, bf16, caplog):
    with caplog.at_level(logging.INFO, logger="handlers.engine.torch.engine"):
        assert TorchEngine(loaded, max_batch_size=2).kv_cache_dtype == "float16"
        assert TorchEngine(bf16, max_batch_size=2).kv_cache_dtype == "bfloat16"
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("KV cache: float16 (auto: 16 bits; the model computes in "
                               "float32") and line.endswith(", 256 bytes per token")
               for line in lines), lines
    assert any(line.startswith("KV cache: bfloat16 (auto: the model computes in bfloat16")
               for line in lines), lines


def alone(model, option: str, prompt: list[int], n: int) -> list:
    """The request's tokens on an engine of its own: one sequence, its prompt in one pass."""
    stepped = DirectStepper(TorchEngine(model, max_batch_size=1, max_prefill_tokens=512,
                                        kv_cache_dtype=option))
    request, tokens = token_request(prompt, n), {}
    stepped.add(request)
    while stepped.has_work:
        collect(stepped.step(), tokens)
    return tokens[(request.request_id, 0)]


@pytest.mark.parametrize("model", ["float32", "bf16"])
@pytest.mark.parametrize("option", ["float16", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("seed", range(2))
def test_a_sequences_answer_does_not_depend_on_its_batch(loaded, bf16, model, option, seed):
    """Random arrivals, prompts (half sharing an opening: prefix reuse), n, aborts, a small
    batch and prefill budget (slot moves, chunking, compaction): each sequence's tokens and
    their log-probabilities are, bit for bit, those of its prompt run alone over the same
    cache dtype."""
    weights = loaded if model == "float32" else bf16
    rng = random.Random(seed)
    stepped = DirectStepper(TorchEngine(weights, max_batch_size=4,
                                        max_prefill_tokens=rng.choice([5, 8, 13]),
                                        prefix_cache_bytes=1 << 20, kv_cache_dtype=option))
    text = weights.tokenizer.encode(TEXT, add_special_tokens=False)
    requests, tokens, aborted = random_schedule(stepped, text, rng)
    for req in requests:
        want = alone(weights, option, req.prompt_token_ids, req.params.max_new_tokens)
        for index in range(req.params.n):
            got = tokens.get((req.request_id, index), [])
            if req.request_id not in aborted:
                assert len(got) == req.params.max_new_tokens
            assert [(t.id, t.logprob) for t in got] == \
                [(t.id, t.logprob) for t in want[: len(got)]], (req.request_id, index)


@pytest.mark.slow
def test_a_float16_cache_keeps_the_embedded_models_answers():
    """SmolLM2 computing in float32 (what `auto` serves on a CPU without fast bf16): over its
    float16 cache nearly every greedy answer is the float32 cache's, token for token (32 of 32
    measured), and perplexity stays within 0.1%; float8 within 2%."""
    results = accuracy.measure(tokens=64, window=512, variants=["kv-float16", "kv-fp8"])
    base = results["float32"]["perplexity"]
    assert results["kv-float16"]["identical"] >= 30 / 32
    assert results["kv-float16"]["perplexity"] <= base * 1.001
    assert results["kv-fp8"]["perplexity"] <= base * 1.02
