"""Prefix caching: the keys and values of recent prompts, kept after their requests end, so a
prompt that starts the same way (a system prompt, a chat's earlier turns) prefills only what is
new.

Each kept prompt is indexed by the chained hash of every one of its whole blocks of BLOCK
tokens, so a lookup walks the new prompt block by block (vLLM's scheme), confirms the match token
by token, then goes on token by token past the last whole block: a prompt reuses all it shares
with a kept one (a system prompt is rarely a whole number of blocks; a repeated prompt reuses
all but its last token), not only whole blocks. Nothing here is paged, so a prefix of any length
loads as cheaply. The runner holds the saved keys/values (`save_prefix` / `load_prefix`); this
class decides what to keep within a budget of tokens, least recently used first out, and counts
queried and reused prompt tokens (the hit rate's two halves, as vLLM's `prefix_cache_queries` /
`prefix_cache_hits`).

A stateful session's conversation is pinned (`pin`): its entry is found as any other but never
evicted for a prompt; sessions only make room for sessions, the least recently used first, and
`release` lets a closed or expired session's entry go.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

BLOCK = 16  # tokens per block: the unit prefixes are found by (and the shortest kept)


class PrefixStore(Protocol):
    """The runner: copies a slot's first positions aside, back into a slot, and lets go."""

    def save_prefix(self, slot: int, length: int) -> Any: ...

    def load_prefix(self, saved: Any, slot: int, length: int) -> None: ...

    def drop_prefix(self, saved: Any) -> None: ...


@dataclass(eq=False)
class _Entry:
    tokens: tuple[int, ...]  # a prompt, at least one block long
    adapter: str | None  # the LoRA adapter its keys/values were computed with
    saved: Any  # the runner's copy of their keys/values
    used: int  # when last kept or reused (a logical clock)
    session: str | None = None  # the stateful session it is pinned for


class PrefixCache:
    def __init__(self, store: PrefixStore, max_tokens: int, counters: dict[str, int],
                 max_entries: int | None = None) -> None:
        self.store = store
        self.max_tokens = max_tokens
        self.max_entries = max_entries  # a store with a fixed number of places (llama.cpp's)
        self.counters = counters  # prefix_cache_queries / prefix_cache_hits, in tokens
        counters.setdefault("prefix_cache_queries", 0)
        counters.setdefault("prefix_cache_hits", 0)
        self._by_hash: dict[int, list[_Entry]] = {}  # block-prefix hash -> entries holding it
        self._entries: list[_Entry] = []
        self._pinned: dict[str, _Entry] = {}  # by session
        self.kept_tokens = 0  # in all entries, at most max_tokens
        self.pinned_tokens = 0  # in sessions' entries (read by stats() from other threads)
        self._clock = itertools.count()

    def restore(self, prompt: Sequence[int], slot: int, adapter: str | None = None) -> int:
        """Load the longest kept prefix of `prompt`, computed with LoRA adapter `adapter` (None:
        the base model), into `slot`, leaving at least one token to prefill (its logits start
        the answer). Returns how many tokens it loaded."""
        entry, length = self._match(prompt, adapter, limit=len(prompt) - 1)
        self.counters["prefix_cache_queries"] += len(prompt)
        if entry is None:
            return 0
        self.store.load_prefix(entry.saved, slot, length)
        entry.used = next(self._clock)
        self.counters["prefix_cache_hits"] += length
        return length

    def keep(self, prompt: Sequence[int], slot: int, adapter: str | None = None) -> None:
        """`slot` holds `prompt`'s keys/values (computed with `adapter`): keep them, unless kept
        already. A kept prefix this one extends gives its place up (the new one serves it too)."""
        length = len(prompt)
        if length < BLOCK or length > self.max_tokens:
            return
        entry, matched = self._match(prompt, adapter, limit=length)
        if entry is not None and matched == length:
            entry.used = next(self._clock)
            return
        if entry is not None and len(entry.tokens) == matched and entry.session is None:
            self._drop(entry)
        if self._make_room(length, [e for e in self._entries if e.session is None]):
            self._add(_Entry(tuple(prompt), adapter, None, 0), slot)

    def pin(self, session: str, tokens: Sequence[int], slot: int, adapter: str | None) -> None:
        """`slot` holds `tokens`' keys/values, a session's conversation so far: keep them for
        the session (in place of what it kept before), making room among unpinned prefixes
        first, then among other sessions'."""
        self.release(session)
        length = len(tokens)
        if length < BLOCK or length > self.max_tokens:
            return
        if self._make_room(length, list(self._entries)):
            self._pinned[session] = self._add(_Entry(tuple(tokens), adapter, None, 0, session),
                                              slot)
            self.pinned_tokens += length

    def release(self, session: str) -> None:
        """Unpin (and drop) what session `session` kept."""
        entry = self._pinned.get(session)
        if entry is not None:
            self._drop(entry)

    def _make_room(self, length: int, evictable: list[_Entry]) -> bool:
        """Drop entries of `evictable` (unpinned before pinned, each least recently used first)
        until `length` more tokens and one more entry fit; False if they cannot."""
        order = sorted(evictable, key=lambda e: (e.session is not None, e.used))
        while self.kept_tokens + length > self.max_tokens or (
                self.max_entries is not None and len(self._entries) >= self.max_entries):
            if not order:
                return False
            self._drop(order.pop(0))
        return True

    def _add(self, entry: _Entry, slot: int) -> _Entry:
        entry.saved = self.store.save_prefix(slot, len(entry.tokens))
        entry.used = next(self._clock)
        self._entries.append(entry)
        self.kept_tokens += len(entry.tokens)
        for key in _block_hashes(entry.tokens, len(entry.tokens), entry.adapter):
            self._by_hash.setdefault(key, []).append(entry)
        return entry

    def forget(self, adapter: str) -> None:
        """Drop every prefix computed with LoRA adapter `adapter`."""
        for entry in [e for e in self._entries if e.adapter == adapter]:
            self._drop(entry)

    def _match(self, prompt: Sequence[int], adapter: str | None, limit: int
               ) -> tuple[_Entry | None, int]:
        """The most recent entry of `adapter` sharing the most whole blocks with `prompt`, and
        how many tokens they share, whole blocks and then single tokens (at most `limit`)."""
        found, length = None, 0
        for blocks, key in enumerate(_block_hashes(prompt, limit, adapter), start=1):
            holders = self._by_hash.get(key)
            if not holders:
                break
            found, length = holders[-1], blocks * BLOCK
        # A hash is not the tokens: confirm, shortening to what truly matches (collisions only).
        if found is not None and found.adapter != adapter:
            return None, 0
        while found is not None and length and found.tokens[:length] != tuple(prompt[:length]):
            length -= BLOCK
        if found is None or not length:
            return None, 0
        end = min(limit, len(found.tokens))
        while length < end and found.tokens[length] == prompt[length]:
            length += 1
        return found, length

    def _drop(self, entry: _Entry) -> None:
        self.store.drop_prefix(entry.saved)
        self._entries.remove(entry)
        if entry.session is not None:
            del self._pinned[entry.session]
            self.pinned_tokens -= len(entry.tokens)
        self.kept_tokens -= len(entry.tokens)
        for key in _block_hashes(entry.tokens, len(entry.tokens), entry.adapter):
            holders = self._by_hash[key]
            holders.remove(entry)
            if not holders:
                del self._by_hash[key]


def _block_hashes(tokens: Sequence[int], limit: int, adapter: str | None) -> Iterator[int]:
    """The chained hash of each whole block prefix of tokens[:limit], under `adapter` (the same
    tokens give other keys and values with another adapter)."""
    key = hash(adapter)
    for start in range(0, limit - BLOCK + 1, BLOCK):
        key = hash((key, *tokens[start : start + BLOCK]))
        yield key
