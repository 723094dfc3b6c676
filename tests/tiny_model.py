"""A tiny random-weight Llama with the real SmolLM2 tokenizer, for fast engine tests, and a
tiny Qwen3 the same way (a family's architecture, chat template and tokens).

The tokenizer comes from the embedded default GGUF through the loader's conversion cache
($LMI_CACHE_DIR, else ~/.cache/lmi-serve): the first call converts the GGUF (~30 s), later ones
read the cache. The weights are fixed by a seed, so every call writes the same model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from family_templates import QWEN3
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from handlers.engine.gguf.cache import cached_gguf_dir
from handlers.model_source import default_model_path

TINY_SEED = 1234


def make_tiny_model_dir(path: Path, cache_dir: Path | None = None, width: int = 64) -> Path:
    """Write a 2-layer, `width`-wide Llama (max_position_embeddings 512) and the SmolLM2
    tokenizer (chat template included) into `path`, a directory `load_model` accepts; return
    `path`."""
    tokenizer = AutoTokenizer.from_pretrained(
        cached_gguf_dir(default_model_path(), cache_dir), local_files_only=True
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


QWEN3_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def make_tiny_qwen3_dir(path: Path, head_dim: int = 16, template: str = QWEN3) -> Path:
    """A 2-layer random Qwen3 with the SmolLM2 tokenizer, Qwen's thinking and tool-call tokens
    added (added tokens, kept in the text, as Qwen's are) and a Qwen3-shaped chat template, or
    another (`head_dim` 64 for vLLM's CPU attention)."""
    tokenizer = AutoTokenizer.from_pretrained(cached_gguf_dir(default_model_path()))
    tokenizer.add_tokens(QWEN3_TOKENS)
    tokenizer.chat_template = template
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=head_dim, max_position_embeddings=1024, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def transformers_greedy(folder: Path, prompt: str, tokens: int) -> str:
    """What transformers' own generate() answers `prompt` with, greedy, exactly `tokens` long:
    the reference the engines are greedy-equal to."""
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:])
