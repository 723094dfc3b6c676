"""The server side of the benchmark: streaming LMI requests to `POST /invocations`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from bench.prompts import prompt
from bench.stats import RequestResult
from bench.stream import StreamTimer
from bench.workloads import Arrival, Progress, closed_loop_prompts


def lmi_body(inputs: str, max_new_tokens: int) -> dict[str, Any]:
    """A streaming, fixed-length (EOS ignored) LMI request."""
    return {
        "inputs": inputs,
        "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos_token": True},
        "stream": True,
    }


def make_client() -> httpx.AsyncClient:
    """One connection per concurrent request, and no timeout: a slow level must still finish."""
    return httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None))


async def stream_request(
    client: httpx.AsyncClient, url: str, text: str, max_new_tokens: int,
    start: float | None = None,
) -> RequestResult:
    """Send one request and time its token lines. `start` defaults to the moment it is sent."""
    timer = StreamTimer(time.perf_counter() if start is None else start, max_new_tokens)
    try:
        async with client.stream(
            "POST", f"{url}/invocations", json=lmi_body(text, max_new_tokens)
        ) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                timer.fail(f"HTTP {response.status_code}: {body[:300]}")
            else:
                async for line in response.aiter_lines():
                    timer.feed(line, time.perf_counter())
    except httpx.HTTPError as exc:
        timer.fail(f"{type(exc).__name__}: {exc}")
    return timer.result(time.perf_counter())


async def closed_loop(
    url: str, concurrency: int, turns: int, max_new_tokens: int, progress: Progress
) -> list[RequestResult]:
    """Workload A: `concurrency` clients, each sending `turns` requests back to back."""
    plan = closed_loop_prompts(concurrency, turns)

    async def client_task(client: httpx.AsyncClient, prompts: list[str]) -> list[RequestResult]:
        results = []
        for text in prompts:
            results.append(await stream_request(client, url, text, max_new_tokens))
            progress(1)
        return results

    async with make_client() as client:
        per_client = await asyncio.gather(*(client_task(client, p) for p in plan))
    return [r for results in per_client for r in results]


async def arrival_trace(url: str, trace: list[Arrival], progress: Progress) -> list[RequestResult]:
    """Workload B: each request sent at its arrival time; its clock starts at that time."""

    async def send(client: httpx.AsyncClient, t0: float, arrival: Arrival) -> RequestResult:
        due = t0 + arrival.at
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        result = await stream_request(client, url, arrival.prompt, arrival.max_new_tokens, due)
        progress(1)
        return result

    async with make_client() as client:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(send(client, t0, a) for a in trace)))


async def warm_up(url: str) -> None:
    """One short request, so the first measured level does not pay for first-call costs."""
    async with make_client() as client:
        result = await stream_request(client, url, prompt(0), 8)
    if result.error:
        raise RuntimeError(f"warm-up request failed: {result.error}")
