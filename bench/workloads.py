"""The two workloads' request plans, and the static-batching schedule for an arrival trace.

Everything here is deterministic and model-free: the server client and the generate() baseline
both draw their requests from these plans, so the two sides see identical work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.prompts import prompt
from bench.stats import RequestResult

Progress = Callable[[int], Any]  # reports requests done; tqdm's `update`


def closed_loop_prompts(concurrency: int, requests_per_client: int) -> list[list[str]]:
    """Workload A: `[client][turn]` prompts; client i's turn j is prompt i * turns + j.

    The generate() baseline runs turn j of every client as one static batch.
    """
    return [
        [prompt(client * requests_per_client + turn) for turn in range(requests_per_client)]
        for client in range(concurrency)
    ]


@dataclass(frozen=True)
class Arrival:
    """Workload B: one request of the trace, arriving `at` seconds after the trace starts."""

    index: int
    at: float
    prompt: str
    max_new_tokens: int


def poisson_trace(
    n: int, rate: float, min_tokens: int, max_tokens: int, seed: int
) -> list[Arrival]:
    """n arrivals of a Poisson process (`rate` per second, the first at 0), output lengths
    drawn uniformly from [min_tokens, max_tokens]; the same seed gives the same trace."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    times = np.cumsum(gaps)
    lengths = rng.integers(min_tokens, max_tokens, size=n, endpoint=True)
    return [Arrival(i, float(times[i]), prompt(i), int(lengths[i])) for i in range(n)]


@dataclass
class BatchTiming:
    """One generate() call: when it started, when each output step's tokens appeared, when it
    returned (all in the same clock's seconds)."""

    start: float
    token_times: list[float]
    end: float


def next_batch(pending: Sequence[Arrival], elapsed: float, max_batch: int) -> list[Arrival]:
    """What an idle static batcher takes at `elapsed` seconds into the trace: the requests that
    have arrived, oldest first, at most `max_batch`. `pending` is sorted by arrival."""
    return [a for a in pending[:max_batch] if a.at <= elapsed]


def run_static_trace(
    trace: Sequence[Arrival],
    run_batch: Callable[[list[Arrival]], BatchTiming],
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    max_batch: int,
) -> list[RequestResult]:
    """Replay `trace` in real time through a static batcher.

    Whenever the model is idle it takes up to `max_batch` waiting requests as one batch, which
    `run_batch` generates to the longest requested length; a request's first token is the
    batch's first step, its answer is delivered when the whole batch returns. If nothing is
    waiting, the batcher sleeps until the next arrival.
    """
    t0 = clock()
    pending = sorted(trace, key=lambda a: a.at)
    results: dict[int, RequestResult] = {}
    while pending:
        elapsed = clock() - t0
        batch = next_batch(pending, elapsed, max_batch)
        if not batch:
            sleep(pending[0].at - elapsed)
            continue
        pending = pending[len(batch) :]
        timing = run_batch(batch)
        for a in batch:
            results[a.index] = _batched_result(a, t0, timing)
    return [results[a.index] for a in trace]


def _batched_result(arrival: Arrival, t0: float, timing: BatchTiming) -> RequestResult:
    useful = min(arrival.max_new_tokens, len(timing.token_times))
    return RequestResult(
        start=t0 + arrival.at,
        first_token=timing.token_times[0] if useful else None,
        last_token=timing.token_times[useful - 1] if useful else None,
        done=timing.end,
        tokens=useful,
        expected_tokens=arrival.max_new_tokens,
        error=None if useful else "batch produced no tokens",
    )
