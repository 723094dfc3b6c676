"""The green-list watermark (engine/torch/watermark.py): text generated with it is detected from
its token ids alone; text generated without it is not."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from handlers.engine.loop.watermark import GAMMA, greenlist, z_score
from handlers.engine.torch.engine import TorchEngine
from handlers.engine.torch.loader import LoadedModel
from handlers.engine.types import GenerationRequest, SamplingParams

TOKENS = 200


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> Iterator[TorchEngine]:
    engine = TorchEngine(loaded, max_batch_size=4)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.shutdown())


def generated(engine: TorchEngine, watermark: bool, seed: int) -> tuple[list[int], int]:
    """The token ids of one sampled generation, and the prompt's last token."""
    params = SamplingParams(max_new_tokens=TOKENS, do_sample=True, seed=seed, ignore_eos=True,
                            watermark=watermark)
    request = GenerationRequest("Once upon a time, in a land far away", params)

    async def run() -> list[int]:
        ids: list[int] = []
        async for output in engine.generate(request):
            ids += [token.id for seq in output.outputs for token in seq.tokens]
        return ids

    ids = asyncio.run(run())
    return ids, request.prompt_token_ids[-1]


def test_the_greenlist_is_gamma_of_the_vocabulary_and_depends_on_the_previous_token():
    green = greenlist(7, 1000).tolist()
    assert len(green) == int(1000 * GAMMA)
    assert set(green) != set(greenlist(8, 1000).tolist())
    # A detector computes it anew (greenlist caches: compare with an uncached computation).
    assert greenlist.__wrapped__(7, 1000).tolist() == green


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_watermarked_text_scores_above_4_and_plain_text_does_not(engine, seed):
    vocab = engine.vocab_size
    marked, previous = generated(engine, watermark=True, seed=seed)
    plain, _ = generated(engine, watermark=False, seed=seed)
    assert len(marked) == len(plain) == TOKENS
    assert z_score(marked, previous, vocab) > 4
    assert z_score(plain, previous, vocab) < 4
