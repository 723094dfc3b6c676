"""Running one request straight on an engine (no server), for the engine tests."""

from __future__ import annotations

from handlers.engine.types import GenerationRequest, SamplingParams


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
