"""The benchmarks' load client: streaming requests, each timed token by token.

Two routes carry the same workloads. LMI's `POST /invocations` (`application/jsonlines`, one
`{"token": …}` line a token) is what the serving benchmark sends; OpenAI's
`POST /v1/completions` (server-sent events, greedy, EOS ignored) is what every server in the
peer benchmark speaks, ours and vLLM's own, so each is measured on the same wire. There a
request's tokens are the `usage.completion_tokens` of its last chunk (a chunk may carry several
tokens) and its first token is its first chunk with text.

The client is aiohttp: it shares the machine's cores with the server it measures, and httpx's
streaming took ~1.7x its CPU (32 streams: ~0.12 against ~0.07 ms per token), which the server
then lacked.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from bench.prompts import prompt
from bench.stats import RequestResult
from bench.workloads import Arrival, Progress, closed_loop_prompts

MODEL = "smollm2-135m-instruct"  # the embedded default's served name


def parse_line(line: bytes) -> dict[str, Any] | None:
    """One stream line as an object; None for a blank line or SSE's `[DONE]`. Tolerates an
    SSE `data:` prefix."""
    line = line.strip()
    if line.startswith(b"data:"):
        line = line[len(b"data:") :].strip()
    if not line or line == b"[DONE]":
        return None
    obj = orjson.loads(line)
    if not isinstance(obj, dict):
        raise ValueError(f"stream line is not a JSON object: {line[:200]!r}")
    return obj


class StreamTimer:
    """Feeds on a request's stream lines and times its tokens; a route's subclass reads them."""

    def __init__(self, start: float, expected_tokens: int) -> None:
        self.start = start
        self.expected_tokens = expected_tokens
        self.tokens = 0
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.error: str | None = None

    def feed(self, line: bytes, now: float) -> None:
        try:
            obj = parse_line(line)
        except ValueError as exc:  # orjson.JSONDecodeError is a ValueError
            self.fail(f"bad stream line: {exc}")
            return
        if obj is not None:
            self.read(obj, now)

    def read(self, obj: dict[str, Any], now: float) -> None:
        raise NotImplementedError

    def stamp(self, now: float) -> None:
        """Text arrived at `now`."""
        self.first_token = self.first_token if self.first_token is not None else now
        self.last_token = now

    def fail(self, message: str) -> None:
        self.error = self.error or message

    def result(self, done: float) -> RequestResult:
        error = self.error
        if error is None and self.tokens == 0:
            error = "stream ended without a token"
        return RequestResult(start=self.start, first_token=self.first_token,
                             last_token=self.last_token, done=done, tokens=self.tokens,
                             expected_tokens=self.expected_tokens, error=error)


class LmiTimer(StreamTimer):
    """Every `{"token": …}` line is one generated token, except the error line the server ends a
    failed stream with (`details.finish_reason == "error"`), which records the error instead."""

    def read(self, obj: dict[str, Any], now: float) -> None:
        details = obj.get("details") or {}
        if details.get("finish_reason") == "error" or "error" in obj:
            self.fail(str(details.get("error") or obj.get("error") or "error in stream"))
        elif "token" in obj:
            self.tokens += 1
            self.stamp(now)


class CompletionTimer(StreamTimer):
    """OpenAI completion chunks: the first with text is the first token; the usage chunk
    counts them all."""

    def feed(self, line: bytes, now: float) -> None:
        if line.startswith(b"data:"):  # SSE comments and other fields carry no chunk
            super().feed(line, now)

    def read(self, obj: dict[str, Any], now: float) -> None:
        if any(choice.get("text") for choice in obj.get("choices") or ()):
            self.stamp(now)
        if obj.get("usage"):
            self.tokens = obj["usage"]["completion_tokens"]


def lmi_body(inputs: str, max_new_tokens: int) -> dict[str, Any]:
    """A streaming, fixed-length (EOS ignored) LMI request."""
    return {
        "inputs": inputs,
        "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos_token": True},
        "stream": True,
    }


def completion_body(text: str, max_tokens: int) -> dict[str, Any]:
    """A streaming, greedy, fixed-length (EOS ignored) OpenAI completion that reports usage."""
    return {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


@dataclass(frozen=True)
class Route:
    """Where a request goes, what it sends and how its answer is timed."""

    path: str
    body: Callable[[str, int], dict[str, Any]]  # (prompt, tokens to generate)
    timer: Callable[[float, int], StreamTimer]  # (start, tokens expected)


LMI = Route("/invocations", lmi_body, LmiTimer)
OPENAI = Route("/v1/completions", completion_body, CompletionTimer)


def session(base_url: str | None = None, timeout: float | None = None) -> aiohttp.ClientSession:
    """One connection per concurrent request; no timeout by default: a slow level must finish."""
    return aiohttp.ClientSession(base_url, connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=timeout))


async def stream_request(http: aiohttp.ClientSession, url: str, route: Route, text: str,
                         max_tokens: int, start: float | None = None) -> RequestResult:
    """Send one request and time its stream. `start` defaults to the moment it is sent."""
    timer = route.timer(time.perf_counter() if start is None else start, max_tokens)
    try:
        async with http.post(f"{url}{route.path}", json=route.body(text, max_tokens)) as response:
            if response.status != 200:
                body = (await response.read()).decode(errors="replace")
                timer.fail(f"HTTP {response.status}: {body[:300]}")
            async for line in response.content:  # line by line
                timer.feed(line, time.perf_counter())
    except aiohttp.ClientError as exc:
        timer.fail(f"{type(exc).__name__}: {exc}")
    return timer.result(time.perf_counter())


async def closed_loop(url: str, route: Route, concurrency: int, turns: int, max_tokens: int,
                      progress: Progress) -> list[RequestResult]:
    """`concurrency` clients (streams), each sending its `turns` requests back to back."""

    async def client_task(http: aiohttp.ClientSession, prompts: list[str]) -> list[RequestResult]:
        results = []
        for text in prompts:
            results.append(await stream_request(http, url, route, text, max_tokens))
            progress(1)
        return results

    async with session() as http:
        per_client = await asyncio.gather(
            *(client_task(http, p) for p in closed_loop_prompts(concurrency, turns)))
    return [r for results in per_client for r in results]


async def arrival_trace(url: str, route: Route, trace: list[Arrival], progress: Progress
                        ) -> list[RequestResult]:
    """Each request sent at its arrival time, its clock started then (queueing counts)."""

    async def send(http: aiohttp.ClientSession, t0: float, arrival: Arrival) -> RequestResult:
        due = t0 + arrival.at
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        result = await stream_request(http, url, route, arrival.prompt,
                                      arrival.max_new_tokens, due)
        progress(1)
        return result

    async with session() as http:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(send(http, t0, a) for a in trace)))


async def warm_up(url: str, route: Route) -> None:
    """One short request, so the first measured level does not pay for first-call costs."""
    async with session() as http:
        result = await stream_request(http, url, route, prompt(0), 8)
    if result.error:
        raise RuntimeError(f"warm-up request failed: {result.error}")
