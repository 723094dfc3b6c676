"""A Llama checkpoint on the CPU is built from its files without transformers' modeling code
(what makes a start take seconds, not ten), and computes what transformers' own model computes,
bit for bit; a checkpoint it does not cover is loaded by transformers."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_model import make_tiny_model_dir
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from handlers.engine.loop.runner import PrefillChunk
from handlers.engine.plain_tokenizer import PlainTokenizer
from handlers.engine.torch.fused_projections import fuse_projections
from handlers.engine.torch.llama_model import LlamaCausalLM
from handlers.engine.torch.loader import load_model
from handlers.engine.torch.model_runner import ModelRunner

PROMPT = "The capital of France is Paris, and the capital of Italy is"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi! 你好"}]


def _untied(tmp_path: Path) -> Path:
    """The tiny model's tokenizer with an untied head, one KV head and another rope theta."""
    directory = make_tiny_model_dir(tmp_path)
    config = LlamaConfig(vocab_size=json.loads((directory / "config.json").read_text())
                         ["vocab_size"], hidden_size=64, intermediate_size=96,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                         max_position_embeddings=512, rope_theta=500000.0,
                         tie_word_embeddings=False)
    torch.manual_seed(7)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def _run(model: torch.nn.Module, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill logits of every prompt position and of six greedy decode steps after them."""
    runner = ModelRunner(model, 2, 128)
    [prefill] = runner.prefill([PrefillChunk(0, ids, 0, all_logits=True)])
    steps, token, length = [], int(prefill[-1].argmax()), len(ids)
    for _ in range(6):
        [logits] = runner.decode([token], [length])
        steps.append(logits)
        token, length = int(logits.argmax()), length + 1
    return prefill, torch.stack(steps)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["tied", "untied"])
def test_it_computes_what_transformers_model_computes(tmp_path: Path, tiny_dir: Path,
                                                      variant: str, dtype: str) -> None:
    directory = tiny_dir if variant == "tied" else _untied(tmp_path)
    ours = load_model(directory, dtype=dtype, device="cpu")
    theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=ours.dtype).eval()
    assert type(ours.model) is LlamaCausalLM and type(theirs) is LlamaForCausalLM
    fuse_projections(theirs)  # ours reads q/k/v and gate/up joined, as they are served
    mine, reference = ours.model.state_dict(), theirs.state_dict()
    assert mine.keys() == reference.keys()
    assert all(torch.equal(mine[name], reference[name]) for name in mine)
    tied = ours.model.lm_head.weight is ours.model.model.embed_tokens.weight
    assert tied == (variant == "tied")
    ids = ours.tokenizer.encode(PROMPT)
    for got, want in zip(_run(ours.model, ids), _run(theirs, ids), strict=True):
        assert torch.equal(got, want)


def test_its_tokenizer_is_the_one_autotokenizer_gives(tiny_dir: Path) -> None:
    ours = load_model(tiny_dir, dtype="fp32", device="cpu").tokenizer
    theirs = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    assert isinstance(ours, PlainTokenizer)  # read without transformers (test_plain_tokenizer.py)
    assert ours.all_special_ids == theirs.all_special_ids
    for text in (PROMPT, "naïve café 東京 🙂", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text) == theirs.encode(text)
    render = [t.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
              for t in (ours, theirs)]
    assert render[0] == render[1] and render[0].endswith("<|im_start|>assistant\n")


def test_a_start_imports_no_modeling_code(tiny_dir: Path) -> None:
    """Loading and running the model leaves transformers (its tokenizer too), scikit-learn and
    torch's compiler unimported (seconds of a start)."""
    script = f"""
import json, sys
from pathlib import Path
from handlers.engine.torch.loader import load_model
from handlers.engine.loop.runner import PrefillChunk
from handlers.engine.torch.model_runner import ModelRunner
loaded = load_model(Path({str(tiny_dir)!r}), device="cpu")
runner = ModelRunner(loaded.model, 2, 64)
runner.prefill([PrefillChunk(0, loaded.tokenizer.encode("Hello there"), 0)])
runner.decode([5], [2])
print(json.dumps(sorted(sys.modules)))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    modules = set(json.loads(done.stdout.splitlines()[-1]))
    assert "handlers.engine.torch.llama_model" in modules and "torch" in modules
    heavy = {"transformers", "sklearn",
             "torch._dynamo", "sentence_transformers", "accelerate"}
    assert heavy.isdisjoint(modules), heavy & modules


@pytest.mark.parametrize(("change", "why"), [
    ({"hidden_act": "gelu"}, "activation gelu"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     "rope ('linear'"),
    ({"architectures": ["LlamaForCausalLMWithExtras"]}, "architecture"),
])
def test_a_checkpoint_it_does_not_cover_is_loaded_by_transformers(
        tmp_path: Path, change: dict, why: str, caplog: pytest.LogCaptureFixture) -> None:
    directory = make_tiny_model_dir(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with caplog.at_level(logging.INFO, logger="handlers.engine.torch.loader"):
        loaded = load_model(directory, dtype="fp32", device="cpu")
    assert type(loaded.model) is LlamaForCausalLM
    assert "with transformers' classes" in caplog.text and why in caplog.text
    assert _run(loaded.model, loaded.tokenizer.encode(PROMPT))[1].shape[0] == 6
