"""Batched sampling: each row follows its own request's settings (random logits, no model)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from handlers.engine.loop import sampling
from handlers.engine.loop.sampling import SequenceSampler, prompt_logprobs, sample
from handlers.engine.types import SamplingParams

V = 64
EOS = 0
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _global_seed() -> None:
    torch.manual_seed(0)  # unseeded rows draw from the global RNG: keep the tests repeatable


def make(
    prompt: tuple[int, ...] = (), vocab: int = V, seed_offset: int = 0, **params
) -> SequenceSampler:
    return SequenceSampler(SamplingParams(**params), list(prompt), {EOS}, vocab, CPU, seed_offset)


def choice(row: torch.Tensor, sampler: SequenceSampler) -> int:
    return sample(row.unsqueeze(0), [sampler]).token_ids[0]


def draw_counts(row: torch.Tensor, n: int = 2000, **params) -> Counter[int]:
    """Sample n unseeded rows holding the same logits in one batch; count each token drawn."""
    samplers = [make(vocab=row.numel(), do_sample=True, **params) for _ in range(n)]
    return Counter(sample(row.repeat(n, 1), samplers).token_ids)


def logits_of(probs: list[float], vocab: int = V) -> torch.Tensor:
    """A row whose softmax is `probs` on the first tokens and 0 on the others."""
    row = torch.full((vocab,), -math.inf)
    row[: len(probs)] = torch.tensor(probs).log()
    return row


def random_logits(*shape: int, scale: float = 2.0, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_is_argmax_whatever_the_sampling_settings() -> None:
    logits = random_logits(6, V)
    samplers = [make(), make(temperature=0.2, top_k=3, top_p=0.1, typical_p=0.2, min_p=0.9)] * 3
    assert sample(logits, samplers).token_ids == logits.argmax(-1).tolist()


def test_sampled_tokens_follow_the_softmax() -> None:
    counts = draw_counts(logits_of([0.5, 0.3, 0.2]), n=4000)
    assert set(counts) == {0, 1, 2}
    for token, p in enumerate([0.5, 0.3, 0.2]):
        assert abs(counts[token] / 4000 - p) < 0.03


def test_temperature_sharpens_and_flattens() -> None:
    row = logits_of([0.5, 0.3, 0.2])
    assert set(draw_counts(row, temperature=0.05)) == {0}
    hot = draw_counts(row, n=4000, temperature=4.0)
    assert hot[2] / 4000 > 0.25  # 0.2 ** 0.25 / sum(p ** 0.25) = 0.29


def test_top_k_keeps_the_k_most_likely() -> None:
    row = torch.linspace(2.0, 0.0, V)
    assert set(draw_counts(row, top_k=3)) == {0, 1, 2}
    assert len(draw_counts(row, top_k=0)) > 3
    assert len(draw_counts(row, top_k=-1)) > 3


def test_top_p_keeps_the_token_that_crosses_p() -> None:
    row = logits_of([0.5, 0.3, 0.2])
    assert set(draw_counts(row, top_p=0.79)) == {0, 1}
    assert set(draw_counts(row, top_p=0.81)) == {0, 1, 2}


def test_min_p_is_relative_to_the_most_likely_token() -> None:
    row = logits_of([0.5, 0.3, 0.15, 0.05])
    assert set(draw_counts(row, min_p=0.2)) == {0, 1, 2}  # keeps p >= 0.1
    assert set(draw_counts(row, min_p=0.35)) == {0, 1}  # keeps p >= 0.175


@pytest.mark.parametrize(
    ("params", "warpers"),
    [
        ({"top_k": 5}, [TopKLogitsWarper(5)]),
        ({"top_p": 0.7}, [TopPLogitsWarper(0.7)]),
        ({"min_p": 0.1}, [MinPLogitsWarper(0.1)]),
        ({"typical_p": 0.6}, [TypicalLogitsWarper(0.6)]),
        ({"typical_p": 0.95}, [TypicalLogitsWarper(0.95)]),
        (
            {"temperature": 0.7, "top_k": 12, "top_p": 0.8},
            [TemperatureLogitsWarper(0.7), TopKLogitsWarper(12), TopPLogitsWarper(0.8)],
        ),
        ({"top_p": 0.8, "typical_p": 0.9}, [TopPLogitsWarper(0.8), TypicalLogitsWarper(0.9)]),
    ],
)
def test_filters_keep_what_hugging_face_keeps(params: dict, warpers: list) -> None:
    row = random_logits(V, scale=1.5, seed=3)
    scores = row.unsqueeze(0)
    for warper in warpers:
        scores = warper(None, scores)
    allowed = set(torch.isfinite(scores[0]).nonzero().flatten().tolist())
    assert scores.softmax(-1)[0, sorted(allowed)].min() > 0.003  # each shows up in 3000 draws
    assert set(draw_counts(row, n=3000, **params)) == allowed


def test_top_p_nucleus_wider_than_the_ranking_window() -> None:
    vocab = 4096
    row = random_logits(vocab, scale=0.5)
    allowed = torch.isfinite(TopPLogitsWarper(0.9)(None, row.unsqueeze(0))[0])
    assert allowed.sum() > 4 * sampling._WINDOW
    drawn = set(draw_counts(row, n=2000, top_p=0.9))
    assert all(allowed[t] for t in drawn)
    assert len(drawn) > sampling._WINDOW


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    row = torch.full((V,), -10.0)
    row[1], row[2] = 2.0, 1.5
    assert choice(row, make(prompt=(1,), repetition_penalty=1.2)) == 1  # 2.0 / 1.2 > 1.5
    assert choice(row, make(prompt=(1,), repetition_penalty=1.4)) == 2  # 2.0 / 1.4 < 1.5
    row[1], row[2] = -1.0, -1.1
    assert choice(row, make(prompt=(1,), repetition_penalty=1.05)) == 1  # -1.05 > -1.1
    assert choice(row, make(prompt=(1,), repetition_penalty=1.2)) == 2  # -1.2 < -1.1
    generated = make(repetition_penalty=1.2)
    assert choice(row, generated) == 1
    generated.append(1)  # generated tokens count as seen too
    assert choice(row, generated) == 2


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    row = torch.full((V,), -10.0)
    row[1], row[2] = 3.0, 2.0
    cases = [  # (params, expected choice after token 1 was generated twice)
        ({"frequency_penalty": 0.4}, 1),  # 3 - 2 * 0.4 = 2.2
        ({"frequency_penalty": 0.6}, 2),  # 3 - 2 * 0.6 = 1.8
        ({"presence_penalty": 0.9}, 1),  # 3 - 0.9 = 2.1
        ({"presence_penalty": 1.1}, 2),  # 3 - 1.1 = 1.9
        ({"frequency_penalty": 0.2, "presence_penalty": 0.5}, 1),  # 3 - 0.4 - 0.5 = 2.1
        ({"frequency_penalty": 0.3, "presence_penalty": 0.5}, 2),  # 3 - 0.6 - 0.5 = 1.9
    ]
    for params, expected in cases:
        sampler = make(prompt=(1, 1, 1, 1), **params)
        assert choice(row, sampler) == 1  # prompt occurrences do not count
        sampler.append(1)
        sampler.append(1)
        assert choice(row, sampler) == expected, params


def test_logit_bias_is_added() -> None:
    row = torch.full((V,), -10.0)
    row[1], row[2] = 1.0, 0.5
    assert choice(row, make(logit_bias={2: 0.6})) == 2
    assert choice(row, make(logit_bias={2: 0.4})) == 1
    assert 0 not in draw_counts(torch.zeros(V), logit_bias={0: -100.0})


def test_min_new_tokens_masks_eos_and_stop_token_ids() -> None:
    row = torch.full((V,), -10.0)
    row[EOS], row[7], row[3] = 5.0, 4.5, 4.0
    sampler = make(min_new_tokens=2, stop_token_ids=[7])
    for _ in range(2):
        assert choice(row, sampler) == 3
        sampler.append(3)
    assert choice(row, sampler) == EOS


def test_ignore_eos_does_not_change_sampling() -> None:
    row = random_logits(V)
    row[EOS] = 10.0
    for params in [{}, {"min_new_tokens": 1}, {"do_sample": True, "seed": 5}]:
        assert choice(row, make(ignore_eos=True, **params)) == choice(row, make(**params))
    assert choice(row, make(ignore_eos=True)) == EOS  # stopping is decided elsewhere


def run(batch: list[tuple[int, SamplingParams]], steps: list[torch.Tensor]) -> dict[int, list]:
    """Decode `steps` with a batch of (sequence label, params); the sequence labelled j reads row
    j of each step's logits wherever it sits in the batch. Returns each label's tokens."""
    vocab = steps[0].shape[-1]
    samplers = [SequenceSampler(params, [], {EOS}, vocab, CPU) for _, params in batch]
    tokens: dict[int, list] = {label: [] for label, _ in batch}
    for step in steps:
        chosen = sample(step[[label for label, _ in batch]], samplers).token_ids
        for (label, _), sampler, token in zip(batch, samplers, chosen, strict=True):
            sampler.append(token)
            tokens[label].append(token)
    return tokens


def test_seeded_tokens_do_not_depend_on_the_batch() -> None:
    steps = [random_logits(5, 1024, seed=s) for s in range(6)]
    for step in steps:
        step[1] *= 0.1  # a flat neighbour whose top_p nucleus is wider than the ranking window
    seeded = SamplingParams(do_sample=True, seed=1234, temperature=0.8, top_p=0.9, top_k=40)
    alone = run([(0, seeded)], steps)[0]
    neighbours = [
        (1, SamplingParams(do_sample=True, top_p=0.95)),
        (2, SamplingParams()),
        (3, SamplingParams(do_sample=True, seed=7, repetition_penalty=1.3, top_logprobs=2)),
        (4, SamplingParams(do_sample=True, typical_p=0.5, min_p=0.05)),
    ]
    for position in range(len(neighbours) + 1):
        batch = [*neighbours[:position], (0, seeded), *neighbours[position:]]
        assert run(batch, steps)[0] == alone
    assert run([(0, seeded), (1, neighbours[0][1])], steps)[0] == alone


def test_different_seeds_and_offsets_give_different_tokens() -> None:
    steps = [random_logits(1, V, scale=0.5, seed=s) for s in range(12)]

    def tokens(seed: int, offset: int = 0) -> list[int]:
        sampler = make(do_sample=True, seed=seed, seed_offset=offset)
        return [choice(step[0], sampler) for step in steps]

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)
    assert tokens(1, offset=0) != tokens(1, offset=1)
    assert tokens(1, offset=1) == tokens(2, offset=0)  # the offset is added to the seed


def test_mixed_batch_gives_each_row_its_own_behaviour() -> None:
    logits = random_logits(4, V)
    seeded = {"do_sample": True, "seed": 3, "top_k": 5}
    samplers = [make(), make(**seeded), make(logit_bias={9: 100.0}), make(**seeded)]
    chosen = sample(logits, samplers).token_ids
    assert chosen[0] == logits[0].argmax()
    assert chosen[1] == choice(logits[1], make(**seeded))
    assert chosen[2] == 9
    assert chosen[3] == choice(logits[3], make(**seeded))
    assert chosen[1] in logits[1].topk(5).indices.tolist()


def test_logprobs_are_the_raw_log_softmax() -> None:
    logits = random_logits(4, V)
    original = logits.clone()
    samplers = [
        make(do_sample=True, temperature=0.3, top_k=3),
        make(repetition_penalty=2.0, prompt=(int(logits[1].argmax()),)),
        make(logit_bias={5: 50.0}),
        make(do_sample=True, top_p=0.5, frequency_penalty=1.0),
    ]
    result = sample(logits, samplers)
    expected = original.log_softmax(-1)[range(4), result.token_ids]
    assert result.logprobs == pytest.approx(expected.tolist(), abs=1e-5)
    assert result.token_ids[2] == 5
    assert torch.equal(logits, original)  # the caller's logits are left untouched


def test_top_alternatives_are_sorted_and_of_the_requested_length() -> None:
    logits = random_logits(3, V)
    samplers = [make(top_logprobs=0), make(top_logprobs=1), make(do_sample=True, top_logprobs=5)]
    top = sample(logits, samplers).top
    assert [len(row) for row in top] == [0, 1, 5]
    values, ids = logits[2].log_softmax(-1).topk(5)
    assert [t for t, _ in top[2]] == ids.tolist()
    assert [lp for _, lp in top[2]] == pytest.approx(values.tolist(), abs=1e-5)
    assert top[1][0][0] == logits[1].argmax()


def test_prompt_logprobs_score_each_token_given_its_prefix() -> None:
    ids = torch.randint(0, V, (300,)).tolist()  # longer than one log-softmax chunk
    logits = random_logits(300, V)
    values = prompt_logprobs(logits, ids)
    expected = logits[:-1].log_softmax(-1)[range(299), ids[1:]]
    assert values[0] is None
    assert values[1:] == pytest.approx(expected.tolist(), abs=1e-5)
    assert prompt_logprobs(logits[:1], ids[:1]) == [None]
