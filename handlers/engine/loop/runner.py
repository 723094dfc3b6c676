"""What the continuous batcher asks of an engine's forward passes: the runner it steps (the
torch engine's `ModelRunner`, the llama.cpp engine's `LlamaCppRunner`).

Every sequence owns one cache slot. A decode pass runs the rows in slots first_slot.. with one
new token each; a prefill pass runs a chunk of prompt tokens for a few sequences. Slots move
(compaction, forking n sequences) through `move` and `swap`; a prompt's first positions are kept
aside and brought back through the `PrefixStore` methods (prefix_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from handlers.engine.loop.prefix_cache import PrefixStore
from handlers.engine.types import MediaInputs


@dataclass
class PrefillChunk:
    slot: int
    token_ids: list[int]  # the chunk's tokens
    start: int  # position of the chunk's first token
    all_logits: bool = False  # logits for every chunk position (prompt logprobs), not just the last
    # A prompt with media: the chunk's input embeddings [len, hidden] (media merged in), read in
    # place of its tokens' own.
    embeds: torch.Tensor | None = None


class RunnerCache(Protocol):
    def shrink(self) -> None:
        """No sequence holds a slot: give back what the running ones grew."""


class Runner(PrefixStore, Protocol):
    vocab_size: int  # the logits' width
    device: torch.device  # where the logits are
    cache: RunnerCache
    # How many prefixes may be kept at once; None: as many as the byte budget holds.
    prefix_places: int | None

    @property
    def kv_bytes_per_token(self) -> int: ...

    def prefill(self, chunks: list[PrefillChunk]) -> list[torch.Tensor]:
        """Per chunk, float32 logits [1, V] (its last position) or [len, V] (`all_logits`)."""

    def decode(self, token_ids: list[int], lengths: list[int], first_slot: int = 0
               ) -> torch.Tensor:
        """One token for each row in slots first_slot.., whose `lengths` tokens are cached:
        float32 logits [B, V]."""

    def prompt_embeddings(self, inputs: MediaInputs) -> torch.Tensor:
        """A prompt's input embeddings [tokens, hidden] with its media encoded and merged in
        (the vision or audio encoder runs here); only runners of multimodal models."""

    def move(self, src: int, dst: int, length: int) -> None: ...

    def swap(self, a: int, b: int, a_len: int, b_len: int) -> None: ...

    def use_adapter(self, slot: int, adapter: str | None) -> bool:
        """The sequence in `slot` runs with LoRA adapter `adapter` (None: the base model); moves
        and swaps carry it along, release ends it. False: not now (the adapters one pass may
        mix are running); the request waits."""

    def release(self, slot: int) -> None:
        """The slot's sequence ended."""


class VerifyingRunner(Runner, Protocol):
    """A runner that verifies speculated tokens (speculation.py): the torch engine's."""

    def verify(self, token_ids: list[list[int]], lengths: list[int]) -> list[torch.Tensor]:
        """For each row in slots 0.., whose `lengths` tokens are cached, its tokens (the last
        generated, then the proposed) in one pass: float32 logits [len, V] per row."""

    def truncate(self, slot: int, length: int) -> None:
        """The slot holds its first `length` positions only (those after were rejected)."""
