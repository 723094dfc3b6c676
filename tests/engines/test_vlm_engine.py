"""The torch engine serving vision-language models through transformers' processors and model
classes: tiny random-weight LLaVA, LLaVA-NeXT and Idefics3 (SmolVLM) checkpoints built here.
Greedy answers equal transformers' own generate() on the processor's inputs, alone and in one
batch beside text rows; media tokens count in the prompt; the prefix cache reuses a prompt's
keys/values only for the same image."""

from __future__ import annotations

import asyncio
import base64

import pytest
from media_files import png
from tiny_vlm import FAMILIES, TEMPLATE, make_tiny_vlm_dir, transformers_vlm_greedy

from handlers.engine.media import MediaLimits, MediaReader
from handlers.engine.torch.engine import TorchEngine
from handlers.engine.torch.loader import load_model
from handlers.engine.types import GenerationRequest, RequestValidationError, SamplingParams

TOKENS = 8


@pytest.fixture(scope="module", params=FAMILIES)
def folder(request, tmp_path_factory):
    return make_tiny_vlm_dir(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def loaded(folder):
    return load_model(folder, dtype="fp32", device="cpu")


@pytest.fixture
async def engine(loaded):
    eng = TorchEngine(loaded, max_batch_size=4, max_prefill_tokens=16,
                      prefix_cache_bytes=32 << 20)
    await eng.start()
    yield eng
    await eng.shutdown()


def image(seed: int):
    reader = MediaReader(frozenset({"image"}), MediaLimits())
    return reader.read("image", base64.b64encode(png(seed=seed)).decode(), "p")


def chat(engine, text: str, images: int = 1) -> str:
    content = [{"type": "text", "text": text}] + [{"type": "image"}] * images
    return engine.tokenizer.hf.apply_chat_template(
        [{"role": "user", "content": content}], chat_template=TEMPLATE, tokenize=False,
        add_generation_prompt=True)


def media_request(engine, text: str, seeds: tuple[int, ...]) -> GenerationRequest:
    return GenerationRequest(prompt=chat(engine, text, len(seeds)),
                             media=tuple(image(s) for s in seeds),
                             params=SamplingParams(max_new_tokens=TOKENS, ignore_eos=True))


async def answer(engine, request: GenerationRequest) -> tuple[list[int], int]:
    ids, prompt_tokens = [], 0
    async for out in engine.generate(request):
        prompt_tokens = out.prompt_token_count
        for seq in out.outputs:
            assert seq.error is None, seq.error
            ids += [t.id for t in seq.tokens]
    return ids, prompt_tokens


def reference(engine, folder, request: GenerationRequest) -> list[int]:
    inputs = engine.media.inputs(request.prompt, request.media)
    return transformers_vlm_greedy(folder, inputs, TOKENS)


async def test_alone_and_beside_text_rows(engine, folder):
    requests = [media_request(engine, "What is in the picture?", (s,)) for s in (0, 1)]
    expected = [reference(engine, folder, r) for r in requests]
    assert expected[0] != expected[1]  # the image decides the answer
    ids, prompt_tokens = await answer(engine, requests[0])
    assert ids == expected[0]
    image_id = next(iter(engine.media.media_ids))
    assert prompt_tokens == len(requests[0].prompt_token_ids)
    assert requests[0].prompt_token_ids.count(image_id) > 1  # media tokens are counted
    text = GenerationRequest(prompt="Tell me a story about a long road and a tall tree.",
                             params=SamplingParams(max_new_tokens=TOKENS, ignore_eos=True))
    again = [media_request(engine, "What is in the picture?", (s,)) for s in (1, 0)]
    answers = await asyncio.gather(*(answer(engine, r) for r in [*again, text]))
    assert [a[0] for a in answers[:2]] == [expected[1], expected[0]]
    assert len(answers[2][0]) == TOKENS


async def test_two_images_in_one_prompt(engine, folder):
    request = media_request(engine, "Compare them.", (2, 3))
    assert (await answer(engine, request))[0] == reference(engine, folder, request)


async def test_prefix_cache_keys_media_by_content(engine, folder):
    """The same prompt text with another image must not reuse the first image's keys."""
    first = media_request(engine, "Describe this image in detail please.", (4,))
    await answer(engine, first)
    hits = engine.stats()["prefix_cache_hits"]
    other = media_request(engine, "Describe this image in detail please.", (5,))
    assert (await answer(engine, other))[0] == reference(engine, folder, other)
    image_at = other.prompt_token_ids.index(next(iter(engine.media.media_ids)))
    assert engine.stats()["prefix_cache_hits"] - hits <= image_at  # the text before it only
    same = media_request(engine, "Describe this image in detail please.", (4,))
    hits = engine.stats()["prefix_cache_hits"]
    assert (await answer(engine, same))[0] == reference(engine, folder, first)
    assert engine.stats()["prefix_cache_hits"] - hits == len(same.prompt_token_ids) - 1


async def test_media_the_model_cannot_take(engine):
    request = media_request(engine, "x", (0,))
    request.params.truncate = 4
    with pytest.raises(RequestValidationError, match="cannot be truncated"):
        engine.validate(request)
    assert engine.tokenizer.media.kinds == frozenset({"image"})


def test_a_family_with_its_own_positions_is_refused(tmp_path):
    """A family the runner's passes were not checked on (LLaVA-OneVision here; Qwen2-VL places
    its media by multimodal rotary positions the runner does not compute) is refused at load,
    naming the families served, rather than answered wrong."""
    import json

    folder = make_tiny_vlm_dir("llava", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llava_onevision"}))
    with pytest.raises(ValueError, match="llava, llava_next, idefics3, not llava_onevision"):
        load_model(folder, dtype="fp32", device="cpu")
