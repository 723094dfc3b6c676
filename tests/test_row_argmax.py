"""Greedy picks through row_argmax: torch.argmax's indices for every row, ties, NaN and
infinities included, and torch's own argmax where the op cannot be built."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from handlers.engine.torch import row_argmax as module
from handlers.engine.torch.row_argmax import available, row_argmax


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


def test_other_devices_dtypes_and_a_missing_compiler_take_torchs_argmax(monkeypatch, caplog):
    half = torch.randn(3, 50, dtype=torch.bfloat16)
    assert torch.equal(row_argmax(half), half.argmax(-1))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("LMI_CACHE_DIR", "/nonexistent-cache")
    module.available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            logits = torch.randn(5, 300)
            assert torch.equal(row_argmax(logits), logits.argmax(-1))
        assert "could not be built" in caplog.text and "torch's slower argmax" in caplog.text
    finally:
        monkeypatch.undo()
        module.available.cache_clear()
