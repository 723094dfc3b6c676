"""Greedy picks through row_argmax: torch.argmax's indices for every row, ties, NaN and
infinities included; row_logsumexp: torch's logsumexp, each row's whatever the rows beside it;
torch's own ops where the native ones cannot be built."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from handlers.engine.loop import row_reductions as module
from handlers.engine.loop.row_reductions import available, row_argmax, row_logsumexp


@pytest.mark.skipif(not available(), reason="no C++ compiler here")
@pytest.mark.parametrize("width", [49152, 37, 16, 1])  # whole vectors, a tail, one, none
def test_it_gives_torchs_argmax(width):
    torch.manual_seed(0)
    logits = torch.randn(40, width) * 4
    logits[1] = -math.inf  # every token masked: the first
    logits[2, width // 2] = math.nan  # a NaN wins, as in torch
    logits[3, -1] = logits[3, 0] = math.nan  # the first NaN
    logits[4] = logits[4].max() + 1  # all tied: the first
    logits[5, width // 3] = logits[5, width - 1] = logits[5].max() + 1  # a tie: the first
    logits[6] = 0.0
    logits[6, width // 2:] = -0.0  # +0 and -0 compare equal: the first
    logits[7, -1] = math.inf
    logits[8] = torch.arange(width, 0, -1, dtype=torch.float32)  # the top at the start
    logits[9] = torch.arange(width, dtype=torch.float32)  # at the end, in the tail
    assert torch.equal(row_argmax(logits), logits.argmax(-1))
    assert torch.equal(row_argmax(logits[::3]), logits[::3].argmax(-1))  # strided rows
    assert row_argmax(logits[:0]).shape == (0,)


@pytest.mark.skipif(not available(), reason="no C++ compiler here")
@pytest.mark.parametrize("width", [49152, 37, 16, 1])
@pytest.mark.parametrize("scale", [1.0, 4.0, 30.0])
def test_its_logsumexp_is_torchs(width, scale):
    torch.manual_seed(1)
    logits = torch.randn(33, width) * scale
    logits[1, : width // 2] = -math.inf  # tokens a grammar masks count for nothing
    exact = logits.double().logsumexp(-1)
    got = row_logsumexp(logits)
    assert torch.allclose(got.double(), exact, rtol=2e-6, atol=1e-6)
    assert torch.allclose(got, logits.logsumexp(-1), rtol=2e-6, atol=1e-6)
    assert torch.equal(row_logsumexp(logits[5:6]), got[5:6])  # a row's own, batched or not
    assert torch.equal(row_logsumexp(logits[::3]), got[::3])


@pytest.mark.skipif(not available(), reason="no C++ compiler here")
def test_rows_that_are_not_finite_give_torchs_logsumexp():
    logits = torch.randn(4, 40)
    logits[0] = -math.inf  # every token masked
    logits[1, 7] = math.nan
    logits[2, 9] = math.inf
    got = row_logsumexp(logits)
    assert got[0] == -math.inf and math.isnan(got[1]) and got[2] == math.inf
    torch.testing.assert_close(got, logits.logsumexp(-1), equal_nan=True)


def test_other_devices_dtypes_and_a_missing_compiler_take_torchs_ops(monkeypatch, caplog):
    half = torch.randn(3, 50, dtype=torch.bfloat16)
    assert torch.equal(row_argmax(half), half.argmax(-1))
    assert torch.equal(row_logsumexp(half), half.logsumexp(-1))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("LMI_CACHE_DIR", "/nonexistent-cache")
    module.available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            logits = torch.randn(5, 300)
            assert torch.equal(row_argmax(logits), logits.argmax(-1))
            assert torch.equal(row_logsumexp(logits), logits.logsumexp(-1))
        assert "could not be built" in caplog.text and "torch's slower ops" in caplog.text
    finally:
        monkeypatch.undo()
        module.available.cache_clear()
