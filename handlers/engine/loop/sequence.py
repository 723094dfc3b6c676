"""The state the batcher keeps per request and per generated sequence."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from handlers.engine.detokenize import IncrementalDetokenizer, token_text
from handlers.engine.grammars import SequenceGrammar
from handlers.engine.loop.sampling import SequenceSampler
from handlers.engine.types import (
    FinishReason,
    GenerationRequest,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    SequenceOutput,
    Token,
    TopToken,
)


@dataclass
class Sequence:
    """One of a request's n / best_of sequences; owns a cache slot while it runs."""

    request_id: str
    params: SamplingParams
    index: int
    token_ids: list[int]  # prompt, then generated tokens
    sampler: SequenceSampler
    detokenizer: IncrementalDetokenizer
    slot: int = -1
    cached: int = 0  # tokens whose keys/values are in the cache
    generated: int = 0
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    error: str | None = None
    pending: list[Token] = field(default_factory=list)  # produced since the last output
    grammar: SequenceGrammar | None = None  # structured output: where this sequence is in it
    thinking: Thinking | None = None  # a reasoning model's thinking, before the grammar applies

    @property
    def constraint(self) -> SequenceGrammar | None:
        """The grammar that constrains the next token: none while the model thinks."""
        thinking = self.thinking
        return None if thinking is not None and thinking.started and not thinking.over \
            else self.grammar

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        if self.finished:
            return
        self.finish_reason, self.error = reason, error
        abnormal = reason in (FinishReason.ERROR, FinishReason.ABORT)
        tail = "" if abnormal else self.detokenizer.flush()
        if tail:
            if self.pending:
                self.pending[-1].text += tail
            else:
                self.pending.append(Token(id=self.token_ids[-1], text=tail, logprob=None))

    def take_output(self) -> SequenceOutput | None:
        if not self.pending and not self.finished:
            return None
        tokens, self.pending = self.pending, []
        return SequenceOutput(
            index=self.index,
            tokens=tokens,
            finish_reason=self.finish_reason,
            error=self.error,
            cumulative_logprob=self.cumulative_logprob,
            generated_tokens=self.generated,
        )


@dataclass
class Thinking:
    """Where a sequence is in its thinking: over once one of `ends` was generated; past
    `budget` tokens, the first end's tokens (`end_ids`) are forced one by one. With
    `open_id`, thinking starts only when the first token is that opening (Qwen3's `<think>`);
    any other first token is the answer's."""

    ends: tuple[str, ...]
    end_ids: list[int]
    budget: int | None = None
    open_id: int | None = None
    spent: int = 0
    over: bool = False
    started: bool = True  # False until the first token says (with `open_id`)
    _tail: str = ""  # the last characters generated, to find `end` across tokens
    _forced: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.started = self.open_id is None

    @property
    def undecided(self) -> bool:
        return not self.started and not self.over

    def add(self, token_id: int, text: str) -> None:
        if self.undecided:  # the first token: the opening, or the answer begins
            self.started, self.over = token_id == self.open_id, token_id != self.open_id
            return
        if self.over:
            return
        self.spent += 1
        self._tail = (self._tail + text)[-4 * max(map(len, self.ends)):]
        if self._forced and self._forced[0] == token_id:
            self._forced.pop(0)
        if any(end in self._tail for end in self.ends):
            self.over, self._forced = True, []
        elif self.budget is not None and self.spent >= self.budget and not self._forced:
            self._forced = list(self.end_ids)

    @property
    def forced(self) -> int | None:
        """The token the next step must take (the budget is spent), or None."""
        return self._forced[0] if self._forced and not self.over else None


@dataclass
class RequestState:
    """A request inside the batcher: its sequences, prefill progress and metrics."""

    request: GenerationRequest
    sequences: list[Sequence]
    metrics: RequestMetrics
    prompt_logprobs: list[Token] | None = None
    embeds: Any = None  # with media: the prompt's input embeddings while it prefills
    sent_first: bool = False
    reported_finish: set[int] = field(default_factory=set)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_token_ids or []

    @property
    def cache_ids(self) -> list[int] | tuple[int, ...]:
        """What the prefix cache matches: the prompt, media tokens keyed by their content."""
        media = self.request.media_inputs
        return self.prompt_ids if media is None else media.cache_ids

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def take_output(self) -> RequestOutput | None:
        outputs = [o for s in self.sequences if s.index not in self.reported_finish
                   if (o := s.take_output()) is not None]
        for out in outputs:
            if out.finished:
                self.reported_finish.add(out.index)
        if not outputs and self.sent_first:
            return None
        if self.finished and self.metrics.finished_time is None:
            self.metrics.finished_time = time.monotonic()
        output = RequestOutput(
            request_id=self.request_id,
            outputs=outputs,
            prompt_token_count=len(self.prompt_ids),
            metrics=self.metrics,
            finished=self.finished,
            prompt_logprobs=None if self.sent_first else self.prompt_logprobs,
        )
        self.sent_first = True
        return output


def make_token(tokenizer, token_id: int, text: str, logprob: float,
               top: list[tuple[int, float]], special_ids: set[int]) -> Token:
    return Token(
        id=token_id,
        text=text,
        logprob=logprob,
        special=token_id in special_ids,
        top=[TopToken(id=i, text=token_text(tokenizer, i), logprob=lp) for i, lp in top],
    )
