"""LoRA adapters made with PEFT for the tests, as users make theirs (`save_pretrained`): random,
with a non-zero B (PEFT starts B at zero, an adapter that changes nothing)."""

from __future__ import annotations

from pathlib import Path

import torch

ATTENTION = ["q_proj", "v_proj"]  # PEFT's default targets for Llama
EVERY_PROJECTION = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, folder: Path, targets: list[str], seed: int, *, rank: int = 8,
                 std: float = 0.1, **config):
    """A PEFT LoRA adapter of the model in `base`, saved in `folder`; returns the PEFT-merged
    transformers model it makes (float32, eval mode): the reference for its greedy text."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                            target_modules=targets, **config))
    for name, parameter in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=std)
    peft.save_pretrained(folder)
    return peft.merge_and_unload().eval()
