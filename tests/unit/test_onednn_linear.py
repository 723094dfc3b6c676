"""oneDNN linears: the same float32 results as `nn.Linear`, for every input shape the engine
feeds them, and a model whose linears are swapped predicts as before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from handlers.engine.torch.onednn_linear import OneDnnLinear, use_onednn_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 64), (32, 64), (3, 7, 64)])
def test_matches_nn_linear(shape, bias):
    linear = nn.Linear(64, 96, bias=bias)
    x = torch.randn(shape)
    with torch.inference_mode():
        torch.testing.assert_close(OneDnnLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_a_non_contiguous_input_is_read_correctly():
    linear = nn.Linear(64, 96)
    hidden = torch.randn(4, 5, 64)
    last = hidden[:, -1]  # the LM head reads the last position of each row: a strided view
    with torch.inference_mode():
        torch.testing.assert_close(OneDnnLinear(linear)(last), linear(last), rtol=1e-5, atol=1e-5)


def test_a_swapped_model_predicts_as_before(tmp_path):
    from tiny_model import make_tiny_model_dir
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model_dir(tmp_path), dtype=torch.float32)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.inference_mode():
        before = model(ids).logits
        assert use_onednn_linears(model) == linears > 0
        after = model(ids).logits
    assert not any(type(m) is nn.Linear for m in model.modules())
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)
    assert use_onednn_linears(model) == 0  # already swapped


def test_other_dtypes_keep_nn_linear():
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16))
    assert use_onednn_linears(model) == 0 and type(model[0]) is nn.Linear
