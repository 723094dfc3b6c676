"""What every protocol does with the engine's outputs: fold a request's `RequestOutput` deltas
into whole sequences, tell whether it failed, and hand rendered stream events to the wire."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from handlers.engine.base import Pair
from handlers.engine.types import FinishReason, RequestOutput, SequenceOutput, Token
from handlers.protocols.errors import ErrorKind, GenerationError

FAILED = (FinishReason.ERROR, FinishReason.ABORT, FinishReason.REFUSED)
UNFINISHED = "the engine ended the request without finishing it"


@dataclass(frozen=True)
class Event:
    """One object of a streamed answer; the wire frames it (a JSON line, an SSE event...).
    `failure` marks the event that ends a failed stream, with why (SageMaker's event stream
    answers it as a ModelStreamError)."""

    data: Any
    failure: str | None = None


@dataclass
class Failure:
    reason: FinishReason | None  # None: the engine left the request unfinished
    message: str

    @property
    def kind(self) -> ErrorKind:
        """An abort is the server shutting down, a refusal the request's own doing; anything
        else, the engine failing."""
        if self.reason is FinishReason.REFUSED:
            return ErrorKind.VALIDATION
        return ErrorKind.UNAVAILABLE if self.reason is FinishReason.ABORT else ErrorKind.FAILED


def _failure(reason: FinishReason | None, error: str | None) -> Failure | None:
    if reason not in FAILED:
        return None
    aborted = reason is FinishReason.ABORT
    return Failure(reason, error or ("request aborted" if aborted else "generation failed"))


def output_failure(output: RequestOutput) -> Failure | None:
    """Why the request failed, when one of its sequences in this output ended in an error or an
    abort (one failed sequence fails the request, as in DJL)."""
    return next((f for s in output.outputs if (f := _failure(s.finish_reason, s.error))), None)


def raise_failure(output: RequestOutput) -> None:
    """GenerationError when this output failed its request."""
    if (failure := output_failure(output)) is not None:
        raise GenerationError(failure.message, failure.kind)


def checked_events(pairs: list[Pair], events_of: Callable[[int, RequestOutput], list[Event]]
                   ) -> list[Event]:
    """Each output's events in turn (`events_of(index, output)`); GenerationError at the first
    output that failed its request: a Renderer's `feed` where any failure ends the answer."""
    events = []
    for index, output in pairs:
        raise_failure(output)
        events += events_of(index, output)
    return events


class Renderer(ABC):
    """How a protocol streams one client request's answer: the events of each step's outputs
    and of a failure, pure functions of the engine's outputs, so that one driver loop serves
    every protocol (handlers/server/driver.py)."""

    # Each event in a chunk of its own (a SageMaker PayloadPart each), or a step's in one.
    event_per_chunk: ClassVar[bool] = True

    @abstractmethod
    def feed(self, pairs: list[Pair]) -> list[Event]:
        """The events of one step's outputs. GenerationError when an output failed its request
        and the protocol answers that as a failure: before the stream's first event, an error
        status; after it, `failed`'s events."""

    @abstractmethod
    def failed(self, error: GenerationError) -> list[Event]:
        """The events that end a stream failing after it began."""

    def done(self) -> list[Event]:
        """The events after the last output (none, unless the protocol closes its streams)."""
        return []

    @property
    def ended(self) -> bool:
        """Whether the answer is whole although requests may still run (what runs is aborted:
        one failed input fails a whole dynamic batch)."""
        return False


@dataclass
class FoldedSequence:
    index: int
    tokens: list[Token] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    cumulative_logprob: float = 0.0
    generated_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)

    @property
    def token_ids(self) -> list[int]:
        return [t.id for t in self.tokens]

    def add(self, seq: SequenceOutput) -> None:
        self.tokens.extend(seq.tokens)
        self.cumulative_logprob = seq.cumulative_logprob
        self.generated_tokens = seq.generated_tokens
        if seq.finish_reason is not None:
            self.finish_reason, self.error = seq.finish_reason, seq.error


@dataclass
class Folded:
    """A whole request: its sequences, prompt facts, and when each output arrived."""

    sequences: dict[int, FoldedSequence] = field(default_factory=dict)
    prompt_token_count: int = 0
    prompt_logprobs: list[Token] | None = None
    token_times: list[float] = field(default_factory=list)  # time.monotonic() per token
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished: bool = False

    def add(self, output: RequestOutput, now: float = 0.0) -> None:
        self._time_tokens(output, now)
        self.prompt_token_count = output.prompt_token_count
        self.arrival_time = output.metrics.arrival_time
        self.first_token_time = output.metrics.first_token_time
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        for seq in output.outputs:
            self.sequences.setdefault(seq.index, FoldedSequence(seq.index)).add(seq)
        self.finished = self.finished or output.finished

    def _time_tokens(self, output: RequestOutput, now: float) -> None:
        """One time per generated token. An engine may deliver several tokens in one output
        (vLLM coalesces steps when its consumer falls behind): they share the interval since the
        previous output evenly, so per-token timings count every token."""
        count = max((len(s.tokens) for s in output.outputs), default=0)
        if not count:
            return
        last = self.token_times[-1] if self.token_times else now
        self.token_times.extend(last + (now - last) * (i + 1) / count for i in range(count))

    def failure(self) -> Failure | None:
        """Why the request as a whole failed, if it did."""
        for state in self.sequences.values():
            if failure := _failure(state.finish_reason, state.error):
                return failure
        if not self.finished or not self.sequences:
            return Failure(None, UNFINISHED)
        return None
