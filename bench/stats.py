"""Per-request measurements and their aggregation into one benchmark level."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class RequestResult:
    """One request's timeline, in `time.perf_counter()` seconds.

    `start` is when the request was sent (closed loop) or arrived (arrival trace); `done` is when
    the client holds the whole answer: the stream's end for the server, the batch's end for a
    static batch.
    """

    start: float
    first_token: float | None
    last_token: float | None
    done: float
    tokens: int
    expected_tokens: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time between output tokens after the first; None below two tokens."""
        if self.first_token is None or self.last_token is None or self.tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.tokens - 1)

    @property
    def latency(self) -> float:
        return self.done - self.start


def percentile(values: Sequence[float | None], q: float) -> float | None:
    """The q-th percentile (0-100, linear interpolation) of the values that are not None."""
    present = [v for v in values if v is not None]
    return float(np.percentile(present, q)) if present else None


def wall_time(results: Sequence[RequestResult]) -> float:
    """From the first request's start to the last one's answer."""
    return max(r.done for r in results) - min(r.start for r in results) if results else 0.0


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """Aggregate one level: generated tokens/s over its wall time, and latency percentiles.

    Only successful requests' tokens count. `short` counts successful requests that produced a
    different number of tokens than asked for (the length is meant to be fixed).
    """
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    summary: dict[str, Any] = {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "short": sum(r.tokens != r.expected_tokens for r in ok),
        "tokens": tokens,
        "wall_s": wall_s,
        "tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        # what went wrong, so a failed request can be traced: up to three, each once
        "error_examples": sorted({r.error or f"no text in {r.tokens} tokens"
                                  for r in results if not r.ok})[:3],
    }
    for name in ("ttft", "tpot", "latency"):
        values = [getattr(r, name) for r in ok]
        summary[f"{name}_p50_s"] = percentile(values, 50)
        summary[f"{name}_p99_s"] = percentile(values, 99)
    return summary


def level(results: Sequence[RequestResult], **names: Any) -> dict[str, Any]:
    """One level of a benchmark: what names it, then its summary over its wall time."""
    return {**names, **summarize(results, wall_time(results))}


def samples(results: Sequence[RequestResult]) -> list[dict[str, Any]]:
    """Every request's own numbers."""
    return [{"ttft_s": r.ttft, "tpot_s": r.tpot, "latency_s": r.latency, "tokens": r.tokens,
             "expected_tokens": r.expected_tokens, "error": r.error} for r in results]
