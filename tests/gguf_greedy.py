"""Greedy answers of a loaded model, decoded through the torch engine's runner (prefill, then one
row per step): what the GGUF tests compare between the ways a GGUF is served.

    python tests/gguf_greedy.py record   # rewrites tests/golden/gguf_greedy.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from bench.gguf_shapes import Shape, write_llama_gguf
from handlers.engine.loop.runner import PrefillChunk
from handlers.engine.torch.loader import LoadedModel, load_model
from handlers.engine.torch.model_runner import ModelRunner
from handlers.model_source import default_model_path

GOLDEN = Path(__file__).with_name("golden") / "gguf_greedy.json"
PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers:")
NEW_TOKENS = 24
# A small random Llama (4-bit linears and head, 8-bit embedding) beside the embedded model (its
# head tied, 8-bit).
TEST_SHAPE = Shape(hidden=256, layers=4, heads=8, kv_heads=4, ffn=768, tied=False, spread=0.08)


def test_model(directory: Path) -> Path:
    """The random test GGUF (seeded: the same bytes every time)."""
    from gguf import GGMLQuantizationType as Kind

    return write_llama_gguf(directory / "random-llama.Q4_0.gguf", TEST_SHAPE, Kind.Q4_0,
                            seed=7, embedding_kind=Kind.Q8_0)


def greedy(loaded: LoadedModel, prompts: tuple[str, ...] = PROMPTS,
           new_tokens: int = NEW_TOKENS) -> dict[str, list[int]]:
    """Each prompt's ids, then its greedy continuation, by prompt."""
    runner = ModelRunner(loaded.model, num_slots=1, max_len=256)
    answers = {}
    for prompt in prompts:
        ids = loaded.tokenizer.encode(prompt)
        logits = runner.prefill([PrefillChunk(slot=0, token_ids=ids, start=0)])[0]
        tokens = [int(torch.argmax(logits[-1]))]
        for _ in range(new_tokens - 1):
            step = runner.decode([tokens[-1]], [len(ids) + len(tokens) - 1])
            tokens.append(int(torch.argmax(step[0])))
        runner.release(0)
        answers[prompt] = list(ids) + tokens
    return answers


def record(directory: Path) -> dict[str, dict[str, list[int]]]:
    models = {"embedded": default_model_path(), "random": test_model(directory)}
    return {name: greedy(load_model(path, dtype="fp32", cache_dir=directory, quantize="gguf"))
            for name, path in models.items()}


if __name__ == "__main__" and sys.argv[1:] == ["record"]:
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        GOLDEN.write_text(json.dumps(record(Path(scratch))) + "\n")
