"""Memory-aware admission: the batcher starts a request only while the KV cache positions it may
need fit the engine's budget (kv_budget.py), so no load makes the cache outgrow the memory.

A request reserves, for each of its sequences (each holds its own copy of the prompt), the
positions it can reach: its prompt and max_new_tokens, at most the context. The reservation is
whole from the start and released when the request ends: a running sequence never runs out of
room, so nothing is preempted or recomputed, and a request that waits starts once enough of
those ahead of it end (the batcher stops admitting at the first that does not fit, so none
is overtaken for ever). A request that would need more than the whole budget reserves all of
it, once it runs alone, and generates until its sequences hold their share (finish reason
`length`, as at the end of the context); one whose prompt and one generated token cannot fit
is refused at validation (`refusal`).
"""

from __future__ import annotations

import dataclasses

from handlers.engine.kv_budget import KVBudget
from handlers.engine.types import GenerationRequest, RequestValidationError

UNBOUNDED = 1 << 62  # positions: an engine without a budget


class TokenBudget:
    def __init__(self, tokens: int, max_model_len: int, source: str) -> None:
        """`tokens`: KV positions the budget holds; `source`: the setting (or the memory
        measure) it comes from, for errors and the log."""
        self.tokens = tokens
        self.max_model_len = max_model_len
        self.source = source
        self.reserved = 0
        self.peak = 0  # the most positions reserved at once
        self.waits = 0  # requests that waited for room
        self._held: dict[str, int] = {}
        self._waiting: set[str] = set()

    @classmethod
    def of(cls, budget: KVBudget | None, bytes_per_token: int, max_model_len: int
           ) -> TokenBudget:
        """The positions `budget` holds (no bound without one)."""
        if budget is None:
            return cls(UNBOUNDED, max_model_len, "no budget")
        return cls(budget.bytes // bytes_per_token, max_model_len, budget.source)

    def need(self, request: GenerationRequest) -> tuple[int, int]:
        """(positions to reserve, max_new_tokens the reservation allows)."""
        sequences, prompt = request.params.num_sequences, len(request.prompt_token_ids or ())
        each = min(prompt + request.params.max_new_tokens, self.max_model_len,
                   self.tokens // sequences)
        return sequences * each, min(request.params.max_new_tokens, each - prompt)

    def fits(self, request: GenerationRequest, queue: list[GenerationRequest]) -> bool:
        """Whether `request` may start now; where it may not, it and the rest of the `queue`
        (which wait behind it) count as waiting for room."""
        if self.reserved + self.need(request)[0] <= self.tokens:
            return True
        for waiting in queue:
            if waiting.request_id not in self._waiting:
                self._waiting.add(waiting.request_id)
                self.waits += 1
        return False

    def reserve(self, request: GenerationRequest) -> None:
        """`request` starts: hold what it needs, its max_new_tokens cut to what that allows;
        RequestValidationError for a prompt that cannot fit (one added without validation)."""
        params = request.params
        if why := self.refusal(len(request.prompt_token_ids or ()), params.num_sequences):
            raise RequestValidationError("inputs", why)
        need, max_new_tokens = self.need(request)
        if max_new_tokens < params.max_new_tokens:
            request.params = dataclasses.replace(params, max_new_tokens=max_new_tokens)
        self._held[request.request_id] = need
        self._waiting.discard(request.request_id)
        self.reserved += need
        self.peak = max(self.peak, self.reserved)

    def release(self, request_id: str) -> None:
        """The request ended (or never started): its room is free."""
        self.reserved -= self._held.pop(request_id, 0)
        self._waiting.discard(request_id)

    def refusal(self, prompt_tokens: int, sequences: int) -> str | None:
        """Why a prompt can never run within the budget (None: it can)."""
        need = sequences * (prompt_tokens + 1)
        if need <= self.tokens:
            return None
        what = f"{sequences} sequences of a {prompt_tokens}-token prompt" if sequences > 1 \
            else f"a {prompt_tokens}-token prompt"
        return (f"{what} and one generated token need {need} KV cache positions, but the KV "
                f"cache's budget holds {self.tokens} tokens, so no context runs past that "
                f"({self.source})")

    def stats(self) -> dict[str, int]:
        if self.tokens == UNBOUNDED:
            return {}
        return {"kv_cache_budget_tokens": self.tokens, "kv_cache_reserved_tokens": self.reserved,
                "kv_cache_reserved_tokens_peak": self.peak, "kv_cache_budget_waits": self.waits}
