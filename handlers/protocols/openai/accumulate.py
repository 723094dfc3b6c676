"""Folding an engine's `RequestOutput` stream into choices, and the parts every answer shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from handlers.engine.types import FinishReason, RequestOutput, SequenceOutput, Token
from handlers.protocols.openai.logprobs import TokenText

FAILED = (FinishReason.ERROR, FinishReason.ABORT)


@dataclass(frozen=True)
class ResponseContext:
    """What every object of one answer repeats, and how to spell a token id."""

    id: str
    created: int
    model: str
    token_text: TokenText


def finish_reason(reason: FinishReason | None, tool_calls: bool = False) -> str | None:
    """OpenAI's finish_reason: length (the cap cut the output, even a call's arguments),
    tool_calls (a call was made), else stop (EOS, a stop string or token)."""
    if reason is None:
        return None
    if reason is FinishReason.LENGTH:
        return "length"
    return "tool_calls" if tool_calls else "stop"


def failure(output: RequestOutput) -> str | None:
    """Why the request failed, when one of its sequences ended in an error or an abort."""
    for seq in output.outputs:
        if seq.finish_reason in FAILED:
            return seq.error or ("request aborted" if seq.finish_reason is FinishReason.ABORT
                                 else "generation failed")
    return None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def stream_chunk(ctx: ResponseContext, obj: str, choices: list[dict[str, Any]],
                 include_usage: bool, **extra: Any) -> dict[str, Any]:
    """One streamed object; with `include_usage`, every chunk carries `usage: null` as OpenAI's."""
    out = {"id": ctx.id, "object": obj, "created": ctx.created, "model": ctx.model,
           "choices": choices}
    if include_usage:
        out["usage"] = None
    return {**out, **extra}


def add_final_usage(chunks: list[dict[str, Any]], total: dict[str, int], include_usage: bool,
                    chunk: Callable[..., dict[str, Any]]) -> None:
    """The answer's usage: on OpenAI's extra chunk with no choices when the client asked
    (`stream_options.include_usage`), else on the last chunk (MindIE)."""
    if include_usage or not chunks:
        chunks.append(chunk([], usage=total))
    else:
        chunks[-1]["usage"] = total


@dataclass
class Choice:
    index: int
    tokens: list[Token] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    cumulative_logprob: float = 0.0
    generated_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)

    def add(self, seq: SequenceOutput) -> None:
        self.tokens.extend(seq.tokens)
        self.cumulative_logprob = seq.cumulative_logprob
        self.generated_tokens = seq.generated_tokens
        self.finish_reason = seq.finish_reason or self.finish_reason


@dataclass
class Collected:
    """A whole request: its choices, prompt facts and when each output arrived."""

    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_token_count: int = 0
    prompt_logprobs: list[Token] | None = None
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() per output
    first_token_time: float | None = None
    arrival_time: float = 0.0
    finished: bool = False

    def add(self, output: RequestOutput, now: float) -> None:
        self.arrivals.append(now)
        self.prompt_token_count = output.prompt_token_count
        self.arrival_time = output.metrics.arrival_time
        self.first_token_time = output.metrics.first_token_time
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        for seq in output.outputs:
            self.choices.setdefault(seq.index, Choice(seq.index)).add(seq)
        self.finished = self.finished or output.finished

    def ranked(self, n: int) -> list[Choice]:
        """The `n` best choices by cumulative log-probability (all of them when none was cut)."""
        choices = sorted(self.choices.values(), key=lambda c: c.index)
        if len(choices) <= n:
            return choices
        return sorted(choices, key=lambda c: (-c.cumulative_logprob, c.index))[:n]

    def completion_tokens(self, choices: list[Choice]) -> int:
        return sum(c.generated_tokens for c in choices)

    def timings_ms(self) -> tuple[float, list[float]]:
        """MindIE's `prefill_time` (to the first token) and `decode_time_arr` (per later step)."""
        first = self.first_token_time or (self.arrivals[0] if self.arrivals else 0.0)
        prefill = max(first - self.arrival_time, 0.0) * 1000
        steps = [(b - a) * 1000 for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]
        return round(prefill, 3), [round(s, 3) for s in steps]
