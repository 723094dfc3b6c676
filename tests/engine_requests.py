"""Running requests straight on an engine (no server), for the engine tests: one at a time,
or schedules stepped by hand."""

from __future__ import annotations

import random

from handlers.engine.types import FinishReason, GenerationRequest, SamplingParams


async def run(engine, prompt: str, **params) -> list[dict]:
    """A request's outputs per sequence: token ids, text, tokens, finish reason and cumulative
    log-probability."""
    request = GenerationRequest(prompt=prompt, params=SamplingParams(**params))
    seqs: dict[int, dict] = {}
    async for out in engine.generate(request):
        for s in out.outputs:
            seq = seqs.setdefault(s.index, {"ids": [], "text": "", "tokens": []})
            seq["ids"] += [t.id for t in s.tokens]
            seq["tokens"] += s.tokens
            seq["text"] += s.text
            seq["finish"] = s.finish_reason
            seq["cumulative"] = s.cumulative_logprob
    return [seqs[i] for i in sorted(seqs)]


# -- schedules stepped by hand (the engine's add()/step(), as the DJL entry drives it) ----------

Tokens = dict[tuple[str, int], list]  # (request id, sequence index) -> its Token objects


def token_request(prompt_ids: list[int], max_new_tokens: int, n: int = 1) -> GenerationRequest:
    return GenerationRequest(prompt="", prompt_token_ids=prompt_ids, params=SamplingParams(
        max_new_tokens=max_new_tokens, ignore_eos=True, n=n))


def collect(outputs, tokens: Tokens) -> None:
    """Add the outputs' tokens to `tokens`; no sequence may fail."""
    for out in outputs:
        for seq in out.outputs:
            assert seq.finish_reason != FinishReason.ERROR, seq.error
            tokens.setdefault((out.request_id, seq.index), []).extend(seq.tokens)


def prompt_moved_mid_prefill(engine, ids: list[int]) -> tuple[list[GenerationRequest], Tokens]:
    """On an engine of 4 slots prefilling 8 tokens a step: prompt A ends its prefill in the pass
    that also runs B's first chunk, and takes the decode slot B sits in, so B moves."""
    first = token_request(ids[:4], 12)  # decodes in slot 0 throughout
    brief = token_request(ids[4:8], 1)  # slot 1, freed in step 2 (one token, from its prefill)
    a = token_request(ids[:10], 6)  # slot 2: 4 tokens in step 2, its last 6 in step 3
    b = token_request(ids[2:14], 6)  # slot 1 from step 3: its first 2 tokens in step 3
    tokens: Tokens = {}
    engine.add(first)
    collect(engine.step(), tokens)
    engine.add(brief)
    engine.add(a)
    collect(engine.step(), tokens)
    engine.add(b)
    while engine.has_work:
        collect(engine.step(), tokens)
    return [first, brief, a, b], tokens


def random_schedule(engine, text: list[int], rng: random.Random
                    ) -> tuple[list[GenerationRequest], Tokens, set[str]]:
    """Ten requests (half of them opening as `text` does; 3-30 prompt tokens, 1-8 new ones,
    n of 1 or 2) arriving 0-2 a step, one in ten steps aborting a started one; returns them,
    their sequences' tokens and the ids aborted."""
    pending = []
    for _ in range(10):
        start = 0 if rng.random() < 0.5 else rng.randrange(len(text) - 30)
        pending.append(token_request(text[start : start + rng.randint(3, 30)],
                                     rng.randint(1, 8), n=rng.choice([1, 1, 2])))
    requests, started, aborted, tokens = list(pending), [], set(), {}
    while pending or engine.has_work:
        for _ in range(rng.randint(0, 2)):
            if pending:
                engine.add(pending[0])
                started.append(pending.pop(0).request_id)
        if started and rng.random() < 0.1:
            victim = rng.choice(started)  # waiting, prefilling, decoding or done
            aborted.add(victim)
            engine.cancel(victim)
        collect(engine.step(), tokens)
    return requests, tokens, aborted
