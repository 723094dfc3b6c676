"""Soak: lmi-serve under mixed traffic for a long while (default 20 minutes), sampling the
server's RSS, open files, threads and KV-cache slots in use every `--interval` seconds; after
warm-up the samples should stay flat. Traffic: whole answers, streams read to the end, streams
the client drops after a few tokens, requests past a 1 ms deadline (KServe V2 `timeout`) and
invalid requests, from `--clients` concurrent clients. Prints a table, saves JSON and a PNG.

    .venv/bin/python -m bench.soak                       # 20 minutes, the embedded default
    .venv/bin/python -m bench.soak --minutes 2 --interval 10   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench import client
from bench.launcher import ServerProcess, lmi_serve, thread_env
from bench.prompts import QUESTIONS, prompt
from bench.report import RESULTS, figure, format_table, progress, write_json


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--interval", type=float, default=60, help="seconds between samples")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=psutil.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


# -- the traffic ------------------------------------------------------------------------------


async def whole(http: aiohttp.ClientSession, rng: random.Random) -> str:
    body = {"inputs": prompt(rng.randrange(1000)),
            "parameters": {"max_new_tokens": rng.randint(8, 48)}}
    async with http.post("/invocations", json=body) as response:
        await response.read()
        return "whole" if response.status == 200 else "error"


async def stream(http: aiohttp.ClientSession, rng: random.Random, drop_after: int | None
                 ) -> str:
    body = {"messages": [{"role": "user", "content": rng.choice(QUESTIONS)}],
            "max_tokens": 48, "stream": True}
    async with http.post("/v1/chat/completions", json=body) as response:
        events = 0
        async for _line in response.content:
            events += 1
            if drop_after is not None and events >= drop_after:
                return "dropped"  # leaving the block unread closes the connection mid-stream
    return "streamed" if response.status == 200 else "error"


async def past_deadline(http: aiohttp.ClientSession, rng: random.Random) -> str:
    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                        "data": [rng.choice(QUESTIONS)]}],
            "parameters": {"max_new_tokens": 64, "timeout": 1000}}  # microseconds
    async with http.post(f"/v2/models/{client.MODEL}/infer", json=body) as response:
        return "timed out" if "deadline" in await response.text() else "error"


async def invalid(http: aiohttp.ClientSession, rng: random.Random) -> str:
    body = {"inputs": "x", "parameters": {"max_new_tokens": -rng.randint(1, 9)}}
    async with http.post("/invocations", json=body) as response:
        await response.read()
        return "refused" if 400 <= response.status < 500 else "error"


async def one(http: aiohttp.ClientSession, rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.35:
        return await whole(http, rng)
    if kind < 0.6:
        return await stream(http, rng, None)
    if kind < 0.8:
        return await stream(http, rng, rng.randint(2, 6))
    if kind < 0.9:
        return await past_deadline(http, rng)
    return await invalid(http, rng)


async def traffic(url: str, seed: int, until: float, outcomes: Counter) -> None:
    """One client's requests, one after another, until `until` (time.monotonic())."""
    rng = random.Random(seed)
    async with client.session(url, timeout=300) as http:
        while time.monotonic() < until:
            try:
                outcomes[await one(http, rng)] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError):
                outcomes["transport error"] += 1


# -- the samples ------------------------------------------------------------------------------


def metric(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return float("nan")


def sample(server: psutil.Process, url: str, started: float, outcomes: Counter) -> dict[str, Any]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {"minute": round((time.monotonic() - started) / 60, 2),
            "rss_mb": round(server.memory_info().rss / 2**20, 1),
            "open_files": server.num_fds(), "threads": server.num_threads(),
            "slots_in_use": metric(text, "lmi_kv_cache_slots_in_use"),
            "running": metric(text, "lmi_running_requests"),
            "requests": sum(outcomes.values())}


async def soak(url: str, server: psutil.Process, args: argparse.Namespace
               ) -> tuple[list[dict[str, Any]], Counter]:
    outcomes: Counter = Counter()
    started = time.monotonic()
    until = started + args.minutes * 60
    clients = [asyncio.create_task(traffic(url, args.seed + i, until, outcomes))
               for i in range(args.clients)]
    samples = [sample(server, url, started, outcomes)]
    with progress(round(args.minutes * 60), unit="s") as bar:
        while time.monotonic() < until:
            await asyncio.sleep(min(args.interval, max(until - time.monotonic(), 0)))
            samples.append(await asyncio.to_thread(sample, server, url, started, outcomes))
            bar.n = min(round(time.monotonic() - started), bar.total)
            bar.set_postfix(requests=sum(outcomes.values()))
            bar.refresh()
    await asyncio.gather(*clients)
    samples.append(await asyncio.to_thread(sample, server, url, started, outcomes))
    return samples, outcomes


# -- the report -------------------------------------------------------------------------------


COLUMNS = ("minute", "rss_mb", "open_files", "threads", "slots_in_use", "running", "requests")


def table(samples: list[dict[str, Any]]) -> str:
    return format_table(COLUMNS, [tuple(str(s[c]) for c in COLUMNS) for s in samples])


def plot(samples: list[dict[str, Any]], path: Path) -> None:
    minutes = [s["minute"] for s in samples]
    with figure(path, 3, (14, 4)) as axes:
        for ax, key, label in zip(axes, ("rss_mb", "open_files", "slots_in_use"),
                                  ("RSS (MiB)", "open files", "KV slots in use (at the sample)"),
                                  strict=True):
            ax.plot(minutes, [s[key] for s in samples], marker="o")
            ax.set_xlabel("minute")
            ax.set_title(label)
            ax.set_ylim(bottom=0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    command = lmi_serve([f"option.max_rolling_batch_size={args.max_batch}", "option.dtype=auto"])
    with ServerProcess(command, args.out / "soak-server.log", thread_env(args.threads)) as server:
        server.wait_ready(600)
        samples, outcomes = asyncio.run(soak(server.url, psutil.Process(server.proc.pid), args))
    print(table(samples))
    print("outcomes:", dict(sorted(outcomes.items())))
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "samples": samples,
           "outcomes": dict(outcomes), "cpu": _cpu()}
    write_json(doc, args.out / f"soak-{stamp}.json")
    plot(samples, args.out / f"soak-{stamp}.png")
    print(f"saved {args.out}/soak-{stamp}.json and .png")
    return 1 if outcomes["error"] or outcomes["transport error"] else 0


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
