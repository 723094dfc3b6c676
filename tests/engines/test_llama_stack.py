"""The Llama forward loop over the slot cache gives bit for bit what the model's own forward
(transformers' modules) gives, in float32 and bfloat16, for prompt chunks and decode rows."""

from __future__ import annotations

import pytest
import torch
from tiny_model import make_tiny_model_dir
from transformers import AutoModelForCausalLM

from handlers.engine.torch.attention import visible_keys
from handlers.engine.torch.llama_stack import LlamaStack
from handlers.engine.torch.model_runner import ModelRunner


def _masked(positions: torch.Tensor) -> torch.Tensor:
    """The additive causal mask [B, 1, T, S] over a float32 cache."""
    keys = torch.arange(int(positions.max()) + 1)
    visible = keys[None, None, :] <= positions[:, :, None]
    return torch.where(visible, 0.0, torch.finfo(torch.float32).min)[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loop_matches_the_models_own_forward(tmp_path, dtype):
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model_dir(tmp_path), dtype=dtype)
    runner = ModelRunner(model, num_slots=3, max_len=64)
    stack = LlamaStack.of(model, 64)
    assert stack is not None
    prompt = torch.randint(0, model.config.vocab_size, (3, 11))
    positions = torch.arange(11).repeat(3, 1)
    decode_ids = torch.randint(0, model.config.vocab_size, (3, 1))
    outputs = []
    with torch.inference_mode():
        for forward in (stack.forward, _decoder_forward(model)):
            runner.cache.bind(slice(0, 3), positions, 11)
            prefill = forward(prompt, positions, _masked(positions), runner.cache)
            runner.cache.bind(slice(0, 3), positions[:, -1:] + 1, 12)
            step = forward(decode_ids, positions[:, -1:] + 1,
                           _masked(positions[:, -1:] + 1), runner.cache)
            outputs.append((prefill, step))
    (loop_prefill, loop_step), (own_prefill, own_step) = outputs
    assert loop_prefill.dtype == dtype
    assert torch.equal(loop_prefill, own_prefill) and torch.equal(loop_step, own_step)


def _decoder_forward(model):
    def forward(ids, positions, mask, cache):
        with visible_keys(positions + 1):  # as ModelRunner calls transformers' modules
            return model.get_decoder()(input_ids=ids, position_ids=positions,
                                       attention_mask=mask, past_key_values=cache,
                                       use_cache=True).last_hidden_state
    return forward


def test_other_architectures_keep_their_own_forward():
    assert LlamaStack.of(torch.nn.Linear(2, 2), 64) is None
