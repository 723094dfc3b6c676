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


def test_a_pinned_session_survives_what_evicts_prompts_and_goes_when_released():
    """A session's conversation stays while other prompts come and go; a second session makes
    room by unpinned prompts first; released, it is gone."""
    cache, prefix, _ = setup(max_tokens=4 * BLOCK)
    turn = list(range(2 * BLOCK + 3))
    fill(cache, 0, len(turn), seed=5)
    prefix.pin("s1", turn, slot=0, adapter=None)
    for seed, start in enumerate((1000, 2000, 3000), start=6):  # each needs the room of two
        prompt = list(range(start, start + 2 * BLOCK))
        fill(cache, 1, len(prompt), seed=seed)
        prefix.keep(prompt, slot=1)
    assert prefix.restore(turn + [9], slot=2) == len(turn)
    assert prefix.pinned_tokens == len(turn)
    other = list(range(5000, 5000 + BLOCK))
    fill(cache, 3, len(other), seed=9)
    prefix.pin("s2", other, slot=3, adapter=None)  # the kept prompt gives way, not s1
    assert prefix.restore(turn + [9], slot=2) == len(turn)
    assert prefix.restore(other + [9], slot=2) == BLOCK
    prefix.release("s1")
    assert prefix.restore(turn + [9], slot=2) == 0
    assert prefix.pinned_tokens == BLOCK


def test_a_prompt_never_evicts_a_session_and_a_new_turn_replaces_the_last():
    cache, prefix, _ = setup(max_tokens=3 * BLOCK)
    first = list(range(2 * BLOCK))
    fill(cache, 0, len(first), seed=10)
    prefix.pin("s", first, slot=0, adapter=None)
    prompt = list(range(7000, 7000 + 2 * BLOCK))
    fill(cache, 1, len(prompt), seed=11)
    prefix.keep(prompt, slot=1)  # no room without the session's: not kept
    assert prefix.restore(prompt + [1], slot=2) == 0
    second = first + list(range(900, 900 + BLOCK))
    fill(cache, 0, len(second), seed=12)
    prefix.pin("s", second, slot=0, adapter=None)  # the next turn's conversation, in its place
    assert prefix.pinned_tokens == len(second) == prefix.kept_tokens
    assert prefix.restore(second + [1], slot=2) == len(second)
