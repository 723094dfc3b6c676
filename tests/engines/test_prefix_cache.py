"""The prefix cache's bookkeeping over a real slot KV cache: what it keeps, what a new prompt
reuses, what gives way when the budget is spent, and the hit counts."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from handlers.engine.loop.prefix_cache import BLOCK, PrefixCache
from handlers.engine.torch.kv_cache import SlotKVCache


def setup(max_tokens: int = 1024) -> tuple[SlotKVCache, PrefixCache, dict[str, int]]:
    cache = SlotKVCache(num_layers=2, num_slots=4, num_kv_heads=2, head_dim=4,
                        dtype=torch.float32, device=torch.device("cpu"), initial_len=64)
    store = SimpleNamespace(save_prefix=cache.save, load_prefix=cache.load,
                            drop_prefix=lambda saved: None)
    counters: dict[str, int] = {}
    return cache, PrefixCache(store, max_tokens, counters), counters


def fill(cache: SlotKVCache, slot: int, length: int, seed: int) -> None:
    """Give the slot's first `length` positions distinct values, as a prefill writes them."""
    gen = torch.Generator().manual_seed(seed)
    cache.bind(torch.tensor([slot]), torch.arange(length)[None, :], length)
    heads, dim = cache.keys[0].shape[1], cache.keys[0].shape[3]
    for layer in range(len(cache.keys)):
        key, value = (torch.randn((1, heads, length, dim), generator=gen) for _ in range(2))
        cache.update(key, value, layer)


def held(cache: SlotKVCache, slot: int, length: int) -> list[torch.Tensor]:
    return [buf[slot, :, :length].clone() for buf in (*cache.keys, *cache.values)]


def test_the_cache_grows_and_shrinks_keeping_what_each_slot_holds():
    """Growing copies what the slots hold; releasing the long sequence gives the room back
    (the other slot's values intact), and an idle cache is back to its first size."""
    cache, _, _ = setup()
    fill(cache, 1, 10, seed=1)
    short = held(cache, 1, 10)
    fill(cache, 0, 300, seed=2)
    assert cache.capacity >= 300 and cache.lengths[:2] == [300, 10]
    assert all(torch.equal(a, b) for a, b in zip(short, held(cache, 1, 10), strict=True))
    cache.release(0)
    assert cache.capacity == 64  # the initial length: twice the 10 still held is less
    assert all(torch.equal(a, b) for a, b in zip(short, held(cache, 1, 10), strict=True))
    cache.release(1)
    assert cache.lengths == [0, 0, 0, 0] and cache.capacity == 64


def test_a_prompt_reuses_all_it_shares_and_it_holds_the_same_values():
    cache, prefix, counters = setup()
    first = list(range(100, 150))  # 3 whole blocks and 2 tokens
    fill(cache, 0, len(first), seed=1)
    prefix.keep(first, slot=0)
    second = first[:40] + [7, 8, 9]  # shares 2 whole blocks and 8 tokens
    assert prefix.restore(second, slot=2) == 40
    for buf in (*cache.keys, *cache.values):
        assert torch.equal(buf[2, :, :40], buf[0, :, :40])
    assert counters == {"prefix_cache_queries": len(second), "prefix_cache_hits": 40}
    assert prefix.restore(first[:10] + [7], slot=3) == 0  # found by whole blocks only
    assert prefix.restore([1, 2, 3] + first, slot=3) == 0  # a prefix, not a substring


def test_a_kept_prompt_leaves_its_last_token_to_prefill():
    cache, prefix, _ = setup()
    prompt = list(range(2 * BLOCK))
    fill(cache, 0, len(prompt), seed=2)
    prefix.keep(prompt, slot=0)
    assert prefix.restore(prompt, slot=1) == len(prompt) - 1  # its logits start the answer


def test_a_longer_prompt_takes_the_place_of_the_prefix_it_extends():
    cache, prefix, _ = setup()
    turn1 = list(range(2 * BLOCK))
    turn2 = turn1 + list(range(500, 500 + 2 * BLOCK))  # the chat went on
    fill(cache, 0, len(turn2), seed=3)
    prefix.keep(turn1, slot=0)
    prefix.keep(turn2, slot=0)
    assert prefix.kept_tokens == len(turn2)  # one entry, serving both
    assert prefix.restore(turn1 + [1], slot=1) == len(turn1)
    assert prefix.restore(turn2 + [1], slot=1) == len(turn2)


def test_the_least_recently_used_prefix_gives_way_when_the_budget_is_spent():
    cache, prefix, _ = setup(max_tokens=4 * BLOCK)
    a, b, c = ([tag] * (2 * BLOCK) for tag in (1, 2, 3))
    for slot, prompt in enumerate((a, b)):
        fill(cache, slot, len(prompt), seed=slot)
        prefix.keep(prompt, slot)
    assert prefix.restore(a + [0], slot=3) == 2 * BLOCK  # a is now the most recently used
    fill(cache, 2, len(c), seed=9)
    prefix.keep(c, slot=2)
    assert prefix.restore(b + [0], slot=3) == 0
    assert prefix.restore(a + [0], slot=3) == prefix.restore(c + [0], slot=3) == 2 * BLOCK
    assert prefix.kept_tokens <= 4 * BLOCK


def test_a_prompt_longer_than_the_budget_is_not_kept():
    cache, prefix, _ = setup(max_tokens=BLOCK)
    prompt = list(range(3 * BLOCK))
    fill(cache, 0, len(prompt), seed=4)
    prefix.keep(prompt, slot=0)
    assert prefix.restore(prompt, slot=1) == 0
