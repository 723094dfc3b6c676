"""What every OpenAI answer shares: finish reasons, usage, the streamed chunk's
envelope, and choices ranked from a folded request (handlers/protocols/outputs.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from handlers.engine.types import FinishReason
from handlers.protocols.chat.answer import ResponseContext
from handlers.protocols.outputs import Folded, FoldedSequence


def finish_reason(reason: FinishReason | None, tool_calls: bool = False) -> str | None:
    """OpenAI's finish_reason: length (the cap cut the output, even a call's arguments),
    tool_calls (a call was made), else stop (EOS, a stop string or token)."""
    if reason is None:
        return None
    if reason is FinishReason.LENGTH:
        return "length"
    return "tool_calls" if tool_calls else "stop"


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


def ranked(col: Folded, n: int) -> list[FoldedSequence]:
    """The `n` best choices by cumulative log-probability (all of them when none was cut)."""
    choices = sorted(col.sequences.values(), key=lambda c: c.index)
    if len(choices) <= n:
        return choices
    return sorted(choices, key=lambda c: (-c.cumulative_logprob, c.index))[:n]


def completion_tokens(choices: list[FoldedSequence]) -> int:
    return sum(c.generated_tokens for c in choices)


def timings_ms(col: Folded) -> tuple[float, list[float]]:
    """MindIE's `prefill_time` (to the first token) and `decode_time_arr` (per later token)."""
    first = col.first_token_time or (col.token_times[0] if col.token_times else 0.0)
    prefill = max(first - col.arrival_time, 0.0) * 1000
    times = col.token_times
    steps = [(b - a) * 1000 for a, b in zip(times, times[1:], strict=False)]
    return round(prefill, 3), [round(s, 3) for s in steps]
