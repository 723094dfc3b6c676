"""Folds an engine's stream of `RequestOutput` deltas into whole sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

from handlers.engine.types import FinishReason, RequestOutput, Token

FAILED = (FinishReason.ERROR, FinishReason.ABORT)


@dataclass
class SequenceState:
    index: int
    tokens: list[Token] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    cumulative_logprob: float = 0.0

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)


@dataclass
class Failure:
    reason: FinishReason
    message: str


@dataclass
class Accumulator:
    sequences: dict[int, SequenceState] = field(default_factory=dict)
    prompt_logprobs: list[Token] | None = None
    finished: bool = False

    def add(self, output: RequestOutput) -> None:
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.finished = self.finished or output.finished
        for seq in output.outputs:
            state = self.sequences.setdefault(seq.index, SequenceState(seq.index))
            state.tokens.extend(seq.tokens)
            state.cumulative_logprob = seq.cumulative_logprob
            if seq.finish_reason is not None:
                state.finish_reason = seq.finish_reason
                state.error = seq.error

    def failure(self) -> Failure | None:
        """Why the request as a whole failed: one failed sequence fails it, as in DJL."""
        for state in self.sequences.values():
            if state.finish_reason in FAILED:
                aborted = state.finish_reason is FinishReason.ABORT
                fallback = "request aborted" if aborted else "generation failed"
                return Failure(state.finish_reason, state.error or fallback)
        if not self.finished or not self.sequences:
            return Failure(FinishReason.ERROR, "the engine ended the request without finishing it")
        return None

    def ranked(self, n: int) -> list[SequenceState]:
        """The `n` best sequences by cumulative log-probability (ties keep engine order)."""
        ordered = sorted(self.sequences.values(), key=lambda s: (-s.cumulative_logprob, s.index))
        return ordered[:n]
