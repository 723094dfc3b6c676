"""The green-list watermark of Kirchenbauer et al. (2023), as TGI applies it: after token `t`,
a fixed fraction GAMMA of the vocabulary, a permutation seeded by HASH_KEY * t, is "green" and
gets DELTA added to its logits. Text generated so holds far more green tokens than chance, which
`z_score` measures from the token ids alone (no model needed).
"""

from __future__ import annotations

import functools
import math

import torch

GAMMA = 0.5
DELTA = 2.0
HASH_KEY = 15485863


@functools.lru_cache(maxsize=4096)
def greenlist(previous: int, vocab_size: int) -> torch.Tensor:
    """The green token ids after `previous` (on the CPU)."""
    generator = torch.Generator().manual_seed(HASH_KEY * previous % 2**63)
    permutation = torch.randperm(vocab_size, generator=generator)
    return permutation[: int(vocab_size * GAMMA)]


def mark(logits: torch.Tensor, rows: list[tuple[int, int]]) -> None:
    """Add DELTA to each listed row's green tokens; `rows` pairs a row with its last token."""
    columns = [greenlist(previous, logits.shape[-1]).to(logits.device) for _, previous in rows]
    index = torch.cat([torch.full_like(c, row) for (row, _), c in zip(rows, columns, strict=True)])
    logits.index_put_((index, torch.cat(columns)), torch.tensor(DELTA, device=logits.device),
                      accumulate=True)


def z_score(token_ids: list[int], previous: int, vocab_size: int) -> float:
    """How many standard deviations the green tokens of `token_ids` (generated after the token
    `previous`) are above chance: well above 4 for watermarked text, near 0 otherwise."""
    green = 0
    for token in token_ids:
        green += bool((greenlist(previous, vocab_size) == token).any())
        previous = token
    count = len(token_ids)
    return (green - GAMMA * count) / math.sqrt(count * GAMMA * (1 - GAMMA))
