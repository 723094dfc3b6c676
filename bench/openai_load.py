"""The peers' common load: OpenAI `POST /v1/completions`, streaming, greedy, EOS ignored.

Every server in the peer benchmark speaks it (ours and vLLM's own), so each is measured on the
same wire. A request's tokens are the `usage.completion_tokens` of its last chunk (a chunk may
carry several tokens); its first token is its first chunk with text.

The client is aiohttp: it shares the machine's cores with the server it measures, and httpx's
streaming took ~1.7x its CPU (32 streams: ~0.12 against ~0.07 ms per token here), which the
server then lacked.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson

from bench.stats import RequestResult
from bench.workloads import Arrival, Progress

MODEL = "smollm2-135m-instruct"


def completion_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def stream_completion(client: aiohttp.ClientSession, url: str, prompt: str,
                            max_tokens: int, start: float | None = None) -> RequestResult:
    start = time.perf_counter() if start is None else start
    first = last = None
    tokens, error = 0, None
    try:
        async with client.post(f"{url}/v1/completions",
                               json=completion_body(prompt, max_tokens)) as response:
            if response.status != 200:
                error = f"HTTP {response.status}: {(await response.read())[:300]!r}"
            async for raw in response.content:  # line by line
                line = raw.rstrip()
                if not line.startswith(b"data:") or line.endswith(b"[DONE]"):
                    continue
                chunk = orjson.loads(line[5:])
                now = time.perf_counter()
                if any(choice.get("text") for choice in chunk.get("choices") or ()):
                    first = first or now
                    last = now
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except aiohttp.ClientError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return RequestResult(start=start, first_token=first, last_token=last,
                         done=time.perf_counter(), tokens=tokens, expected_tokens=max_tokens,
                         error=error)


def client() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None))


async def streams(url: str, prompts: list[list[str]], max_tokens: int,
                  progress: Progress) -> list[RequestResult]:
    """One concurrent stream per list of prompts, each sending its prompts back to back."""
    async def stream(http: aiohttp.ClientSession, texts: list[str]) -> list[RequestResult]:
        results = []
        for text in texts:
            results.append(await stream_completion(http, url, text, max_tokens))
            progress(1)
        return results

    async with client() as http:
        per_stream = await asyncio.gather(*(stream(http, texts) for texts in prompts))
    return [result for results in per_stream for result in results]


async def trace(url: str, arrivals: list[Arrival], progress: Progress) -> list[RequestResult]:
    """Each request sent at its arrival time, its clock started then (queueing counts)."""
    async def send(http: aiohttp.ClientSession, t0: float, arrival: Arrival) -> RequestResult:
        due = t0 + arrival.at
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        result = await stream_completion(http, url, arrival.prompt, arrival.max_new_tokens, due)
        progress(1)
        return result

    async with client() as http:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(send(http, t0, a) for a in arrivals)))
