"""q/k/v and gate/up as one matmul each: the model predicts exactly as before, and a model
fused twice (an engine restart builds a new runner over the same model) is unchanged."""

from __future__ import annotations

import torch
from tiny_model import make_tiny_model_dir
from torch import nn
from transformers import AutoModelForCausalLM

from handlers.engine.torch.fused_projections import ProjectionPart, fuse_projections
from handlers.engine.torch.onednn_linear import use_onednn_linears


def test_a_fused_model_predicts_as_before(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model_dir(tmp_path),
                                                 dtype=torch.float32)
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.inference_mode():
        before = model(ids).logits
        assert fuse_projections(model) == 2 * layers  # attention and MLP of each layer
        fused = model(ids).logits
        assert fuse_projections(model) == 0
        use_onednn_linears(model)
        packed = model(ids).logits
    parts = [m for m in model.modules() if isinstance(m, ProjectionPart)]
    assert len(parts) == 5 * layers and not any(type(m) is nn.Linear for m in model.modules())
    torch.testing.assert_close(fused, before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed, before, rtol=1e-4, atol=1e-5)


def test_projections_of_another_input_size_stay_apart():
    block = nn.Module()
    block.q_proj, block.k_proj, block.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(6, 4)
    assert fuse_projections(block) == 0 and type(block.q_proj) is nn.Linear
