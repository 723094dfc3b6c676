"""The torch engine's LoRA adapters (handlers/engine/torch/lora.py) on the tiny Llama: adapters
made with PEFT give the PEFT-merged model's tokens, alone and mixed in one batch with each other
and the base model; max_loras bounds the adapters one batch mixes (the others wait, then run);
kept prefixes belong to their adapter; an adapter that does not fit the model is refused naming
what is wrong."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import torch
from engine_requests import run
from peft_adapters import ATTENTION, EVERY_PROJECTION, make_adapter
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from handlers.engine.torch.engine import TorchEngine
from handlers.engine.torch.lora import LoraSet
from handlers.engine.types import AdapterError, GenerationRequest, SamplingParams

PROMPT = "The weather today is"
TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tiny_dir, loaded, tmp_path_factory):
    """Three adapters (two of q/v, one of every projection) and each one's greedy tokens, and
    the base model's, as transformers generates them."""
    root = tmp_path_factory.mktemp("adapters")
    ids = loaded.tokenizer.encode(PROMPT, add_special_tokens=False)
    models = {None: AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()}
    for name, targets, seed in (("a1", ATTENTION, 1), ("a2", EVERY_PROJECTION, 2),
                                ("a3", ATTENTION, 3)):
        models[name] = make_adapter(tiny_dir, root / name, targets, seed, rank=4, std=0.5)
    expected = {}
    for name, model in models.items():
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=TOKENS,
                                 min_new_tokens=TOKENS, do_sample=False)
        expected[name] = out[0, len(ids):].tolist()
    assert len({tuple(tokens) for tokens in expected.values()}) == 4, expected
    return root, expected


async def started(loaded, root: Path, max_loras: int = 4, **options) -> TorchEngine:
    lora = LoraSet(max_loras, 16)
    engine = TorchEngine(loaded, max_batch_size=8, lora=lora, **options)
    for name in ("a1", "a2", "a3"):
        await engine.add_adapter(name, root / name)
    await engine.start()
    return engine


async def tokens(engine: TorchEngine, adapter: str | None) -> list[int]:
    request = GenerationRequest(PROMPT, SamplingParams(max_new_tokens=TOKENS, ignore_eos=True),
                                adapter=adapter)
    ids = []
    async for out in engine.generate(request):
        ids += [token.id for token in out.outputs[0].tokens]
    return ids


async def test_each_adapter_gives_the_merged_models_tokens_alone_and_mixed(loaded, adapters):
    root, expected = adapters
    engine = await started(loaded, root)
    try:
        for name in expected:
            assert await tokens(engine, name) == expected[name], name
        names = [None, "a1", "a2", "a3"] * 2
        mixed = await asyncio.gather(*(tokens(engine, name) for name in names))
        assert mixed == [expected[name] for name in names]
    finally:
        await engine.shutdown()


async def test_max_loras_bounds_the_adapters_one_batch_mixes(loaded, adapters):
    """With one slot, the requests of three adapters take turns; each still gets its tokens,
    and the base model's request runs beside whichever adapter holds the slot."""
    root, expected = adapters
    engine = await started(loaded, root, max_loras=1)
    try:
        names = ["a1", "a2", None, "a3", "a1"]
        results = await asyncio.gather(*(tokens(engine, name) for name in names))
        assert results == [expected[name] for name in names]
        assert engine.adapter_activity().max_loras == 1
    finally:
        await engine.shutdown()


async def test_a_kept_prefix_serves_its_own_adapter_only(loaded, adapters):
    root, expected = adapters
    engine = await started(loaded, root, prefix_cache_bytes=16 << 20)
    try:
        for name in (None, "a1", "a2", None, "a1"):  # the same prompt, over and over
            assert await tokens(engine, name) == expected[name], name
        await engine.remove_adapter("a1")  # its prefixes go with it
        await engine.add_adapter("a1", root / "a2")  # the name again, other weights
        assert await tokens(engine, "a1") == expected["a2"]
    finally:
        await engine.shutdown()


async def test_a_removed_adapter_is_refused_and_its_slot_reused(loaded, adapters):
    root, expected = adapters
    engine = await started(loaded, root)
    try:
        await engine.remove_adapter("a2")
        assert engine.adapters == ("a1", "a3")
        with pytest.raises(AdapterError) as missing:
            await engine.remove_adapter("a2")
        assert missing.value.missing
        result = await run(engine, PROMPT, max_new_tokens=2)
        assert result[0]["finish"] is not None
        with pytest.raises(Exception, match="'a2' is not served"):
            engine.validate(GenerationRequest(PROMPT, adapter="a2"))
    finally:
        await engine.shutdown()


def rewritten(source: Path, target: Path, change) -> Path:
    """A copy of adapter `source` whose config and weights `change(config, tensors)` edits."""
    target.mkdir(parents=True)
    config = json.loads((source / "adapter_config.json").read_text())
    tensors = load_file(source / "adapter_model.safetensors")
    change(config, tensors)
    (target / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, target / "adapter_model.safetensors")
    return target


def _shrink(config, tensors):
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = tensors[key][:, :10].contiguous()


def _lm_head(config, tensors):
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    tensors["base_model.model.lm_head.lora_B.weight"] = torch.zeros(8, 4)


def _rank(config, tensors):
    for key in list(tensors):
        shape = tensors[key].shape
        tensors[key] = torch.zeros(32, shape[1]) if "lora_A" in key else torch.zeros(shape[0], 32)


@pytest.mark.parametrize(("change", "message"), [
    (_shrink, "A (4, 10) and B (64, 4) do not fit the base model's 128 -> 64 projection"),
    (_lm_head, "it targets 'lm_head', which is not a projection of this model"),
    (_rank, "has rank 32, above option.max_lora_rank=16"),
    (lambda config, _t: config.update(use_dora=True), "it uses DoRA (use_dora)"),
    (lambda config, _t: config.update(bias="all"), "trained biases (bias='all')"),
])
async def test_an_adapter_that_does_not_fit_is_refused_naming_why(loaded, adapters, tmp_path,
                                                                   change, message):
    root, _ = adapters
    engine = TorchEngine(loaded, max_batch_size=2, lora=LoraSet(4, 16))
    bad = rewritten(root / "a2", tmp_path / "bad", change)
    with pytest.raises(AdapterError, match=re.escape(message)):
        await engine.add_adapter("bad", bad)
    assert engine.adapters == ()
