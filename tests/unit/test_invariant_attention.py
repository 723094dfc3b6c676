"""The CPU attention kernel: SDPA's answer, and for a query the same bits whatever else is in its
pass (the batch's rows and padded length, the query's place in its chunk, the slot, the threads)."""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from handlers.engine import native_build
from handlers.engine.torch import attention, invariant_attention
from handlers.engine.torch.invariant_attention import available, slot_attention

pytestmark = pytest.mark.skipif(not available(), reason="no C++ compiler here")
MIN = torch.finfo(torch.float32).min


def _sdpa(q, k, v, counts):
    keys = torch.arange(k.shape[2])
    mask = torch.where(keys[None, None, :] < counts[:, :, None], 0.0, MIN)[:, None]
    out = scaled_dot_product_attention(q, k.float(), v.float(), attn_mask=mask, scale=0.125,
                                       enable_gqa=True)
    return out.transpose(1, 2)


CACHES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("width", [1, 7, 40])
@pytest.mark.parametrize("size", [64, 40, 96, 128])  # whole 64s, a part of 16 left, 16s, 256
def test_it_gives_sdpas_answer_over_grouped_heads(cache, width, size):
    torch.manual_seed(0)
    buffers = [torch.randn(6, 3, 512, size).to(cache) for _ in range(2)]
    k, v = (b[2:5, :, :300] for b in buffers)  # slots 2..4 of the cache, read in place
    q = torch.randn(3, 9, width, size)
    ends = torch.tensor([300, 250, 131])
    counts = ends[:, None] - width + 1 + torch.arange(width)[None, :]
    got = slot_attention(q, k, v, counts, 0.125)
    assert got.shape == (3, width, 9, size) and got.dtype == torch.float32
    torch.testing.assert_close(got, _sdpa(q, k, v, counts), rtol=1e-5, atol=1e-5)
    # bf16 queries (a bf16 model's; over a bf16 cache, AVX512-BF16's paired dot products where
    # the CPU has them): the float32 answer for those queries, rounded once to bf16
    half = slot_attention(q.bfloat16(), k, v, counts, 0.125)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), _sdpa(q.bfloat16().float(), k, v, counts),
                               rtol=8e-3, atol=1e-4)


def test_a_head_over_256_is_attended_by_sdpa():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 2, 3, 512), torch.randn(1, 1, 8, 512), torch.randn(1, 1, 8, 512)
    counts = torch.tensor([[6, 7, 8]])
    mask = torch.where(torch.arange(8)[None, None, :] < counts[:, :, None], 0.0, MIN)[:, None]
    with pytest.raises(RuntimeError, match="head size over 256"):
        slot_attention(q, k, v, counts, 0.125)
    out, _ = attention.slot_cache_attention(None, q, k, v, mask, scaling=0.125, counts=counts)
    torch.testing.assert_close(out, _sdpa(q, k, v, counts), rtol=1e-5, atol=1e-5)


def test_a_query_sees_nothing_past_its_count():
    torch.manual_seed(1)
    k, v, q = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 1, 16)
    changed_k, changed_v = k.clone(), v.clone()
    changed_k[:, :, 10:], changed_v[:, :, 10:] = 1e4, -1e4
    counts = torch.tensor([[10]])
    assert torch.equal(slot_attention(q, k, v, counts, 0.25),
                       slot_attention(q, changed_k, changed_v, counts, 0.25))
    assert slot_attention(q, k, v, torch.tensor([[0]]), 0.25).abs().sum() == 0


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("size", [64, 80])  # decoding's own path for the sums; the general one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # of the queries
def test_a_querys_result_does_not_depend_on_the_rest_of_its_pass(cache, size, dtype):
    rng = random.Random(0)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    for _ in range(60):
        seen = rng.randint(1, 1200)
        keys, values = torch.randn(3, seen, size), torch.randn(3, seen, size)
        query = torch.randn(9, size, dtype=dtype)
        # alone: one row, one query, exactly its keys
        alone = slot_attention(query[None, :, None], keys[None].to(cache), values[None].to(cache),
                         torch.tensor([[seen]]), 0.125)[0, 0]
        # in a pass: another row, at another place in a chunk, a longer padded length
        rows, width = rng.randint(2, 6), rng.randint(1, 48)
        row, place = rng.randrange(rows), rng.randrange(width)
        length = seen + rng.randint(0, 300)
        k, v = torch.randn(rows, 3, length, size), torch.randn(rows, 3, length, size)
        k[row, :, :seen], v[row, :, :seen] = keys, values
        q = torch.randn(rows, 9, width, size, dtype=dtype)
        q[row, :, place] = query
        counts = torch.randint(1, length + 1, (rows, width))
        counts[row, place] = seen
        torch.set_num_threads(rng.choice([1, threads]))
        try:
            crowd = slot_attention(q, k.to(cache), v.to(cache), counts, 0.125)[row, place]
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(alone, crowd), (seen, rows, width, row, place, length)


_OTHER_BUILD = textwrap.dedent("""
    import sys, torch
    torch.ops.load_library(sys.argv[1])
    passes = torch.load(sys.argv[2])
    torch.save([torch.ops.lmi.slot_attention(*p, 0.125) for p in passes], sys.argv[3])
""")


@pytest.mark.parametrize("march", ["cascadelake", "x86-64-v3"])
def test_the_avx512_and_avx2_builds_give_the_same_bits(march, tmp_path):
    """An image's prebuilt AVX-512 and AVX2 levels against this CPU's own build, float32
    queries over float32, bf16, float16 and float8 caches: decoding's passes and prefills (head
    sizes of whole 64s, and of 16s and 8s left over). AVX2's registers hold half a vector and
    take their own code, which adds each lane's products and folds in the same order; float16
    is widened by F16C there, by AVX-512's conversion here. (Plain x86-64 has no FMA, so its
    products round before they are added; bf16 queries over a bf16 cache take AVX512-BF16's
    pairs where the CPU has them.)"""
    if march not in native_build.runnable_levels():
        pytest.skip(f"this CPU does not run {march}")
    library = native_build.build_level(invariant_attention.SOURCE, march)
    torch.manual_seed(4)
    passes = []
    for cache in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        k, v = (torch.randn(5, 3, 300, 64).to(cache) for _ in range(2))
        passes.append((torch.randn(5, 9, 1, 64), k, v, torch.randint(1, 301, (5, 1))))
        for size in (64, 80, 40):
            k, v = (torch.randn(3, 3, 200, size).to(cache) for _ in range(2))
            counts = torch.arange(161, 201).repeat(3, 1) - torch.tensor([[0], [37], [90]])
            passes.append((torch.randn(3, 9, 40, size), k, v, counts))
    torch.save(passes, tmp_path / "in.pt")
    subprocess.run([sys.executable, "-c", _OTHER_BUILD, str(library), str(tmp_path / "in.pt"),
                    str(tmp_path / "out.pt")], check=True)
    for p, theirs in zip(passes, torch.load(tmp_path / "out.pt"), strict=True):
        assert torch.equal(theirs, slot_attention(*p, 0.125))


def test_without_a_compiler_attention_stays_on_sdpa_in_float32(monkeypatch, caplog):
    """SDPA then reads any cache widened to float32: a float16 cache's answer is SDPA's over the
    same values in float32."""
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("LMI_CACHE_DIR", "/nonexistent-cache")
    invariant_attention.available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert not invariant_attention.available()
        assert "could not be built" in caplog.text and "SDPA" in caplog.text
        q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
        counts = torch.tensor([[6, 7, 8]])
        mask = torch.where(torch.arange(8)[None, None, :] < counts[:, :, None], 0.0, MIN)[:, None]
        for cache in (torch.float32, torch.float16, torch.float8_e4m3fn):
            k16, v16 = k.to(cache), v.to(cache)
            out, _ = attention.slot_cache_attention(None, q, k16, v16, mask, scaling=0.25,
                                                    counts=counts)
            expected = scaled_dot_product_attention(q, k16.float(), v16.float(), attn_mask=mask,
                                                    scale=0.25, enable_gqa=True).transpose(1, 2)
            assert torch.equal(out, expected)
    finally:
        monkeypatch.undo()
        invariant_attention.available.cache_clear()
    assert invariant_attention.available()
