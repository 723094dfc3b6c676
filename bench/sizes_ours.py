"""Our server's side of `bench.sizes`: a first and a warm start of `lmi-serve` on a model, their
times and memory, and on the warm one the prefill rate and the decode rate at each stream count.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import psutil

from bench import client
from bench.launcher import ServerProcess, lmi_serve, thread_env
from bench.prompts import words
from bench.start_memory import memory_kib
from bench.stats import level


class TreeMemory:
    """The most resident memory a process and its descendants held at once (VmRSS summed),
    sampled every `every` seconds while in use: a compiler subprocess's counts too."""

    def __init__(self, pid: int, every: float = 0.2) -> None:
        self.process = psutil.Process(pid)
        self.every = every
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def now(self) -> int:
        """The tree's resident bytes now."""
        total = 0
        for proc in [self.process, *self.process.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):  # ended since it was listed
                total += proc.memory_info().rss
        self.peak = max(self.peak, total)
        return total

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.now()
            except psutil.NoSuchProcess:
                return

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()


def memory(server: ServerProcess, tree: TreeMemory) -> dict[str, float]:
    """Resident now (the tree's) and the peak so far (the tree's sampled, or the server's own
    high-water mark where higher; that one alone too, without a compiler's), in GiB."""
    rss = tree.now()
    own_peak = memory_kib(server.proc.pid)["VmHWM"] * 1024
    return {"rss_gib": rss / 2**30, "peak_gib": max(tree.peak, own_peak) / 2**30,
            "server_peak_gib": own_peak / 2**30}


def ours(model: Path, cache_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """A first start into the empty `cache_dir`, then a warm start from it, under load."""
    first = start(model, cache_dir, args, loaded=False)
    warm = start(model, cache_dir, args, loaded=True)
    return {"first": first, "warm": warm}


def start(model: Path, cache_dir: Path, args: argparse.Namespace, loaded: bool
          ) -> dict[str, Any]:
    # A first request builds C++ kernels inside an engine step (minutes on a busy machine):
    # the stall timeout is raised past that so that the server does not stop itself.
    options = [f"option.model_id={model}", "option.embedding_model_id=none",
               f"option.max_model_len={args.context}", "option.engine_stall_timeout=1800",
               *args.option]
    env = {**thread_env(args.threads), "LMI_CACHE_DIR": str(cache_dir)}
    log = args.out / f"sizes-{model.name}-{'warm' if loaded else 'first'}.log"
    with ServerProcess(lmi_serve(options, args.python), log, env=env) as server, \
            TreeMemory(server.proc.pid) as tree:
        result: dict[str, Any] = {"options": options,
                                  "start_s": server.wait_ready(args.startup_timeout, poll=0.1),
                                  "ready": memory(server, tree)}
        try:
            result["graphs_s"] = server.wait_decode_graphs(args.graphs_timeout)
        except TimeoutError:  # still compiling: what follows runs eagerly meanwhile
            result["graphs_s"] = None
        result["graphs_ready"] = memory(server, tree)
        began = time.perf_counter()
        asyncio.run(client.warm_up(server.url, client.LMI))
        result["first_answer_s"] = time.perf_counter() - began
        result["answered"] = memory(server, tree)  # a mapped file's pages count once read
        if loaded:
            result |= asyncio.run(load(server.url, args))
            result["after_load"] = memory(server, tree)
    return result


async def load(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The prefill rate (best of two prompts), then each stream count's level."""
    prefill = max([await prefill_rate(url, args.prompt_tokens, i) for i in range(2)],
                  key=lambda r: r["tok_s"])
    levels = {}
    for streams in args.streams:
        results = await client.closed_loop(url, client.LMI, streams, args.requests,
                                           args.max_tokens, lambda _: None)
        levels[str(streams)] = level(results, workload="streams", label=str(streams))
    return {"prefill": prefill, "levels": levels}


async def prefill_rate(url: str, tokens: int, offset: int) -> dict[str, float]:
    """A prompt of `tokens` tokens as the server counts them, one token generated, timed to its
    first token."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        found = await http.post("/tokenize", json={"prompt": words(tokens + 16, offset),
                                                   "add_special_tokens": False})
        ids = found.json()["tokens"][:tokens]
        text = (await http.post("/detokenize", json={"tokens": ids})).json()["prompt"]
    async with client.session() as http:
        result = await client.stream_request(http, url, client.LMI, text, 1)
    if result.error or result.ttft is None:
        raise RuntimeError(f"prefill request failed: {result.error}")
    return {"tokens": len(ids), "seconds": result.ttft, "tok_s": len(ids) / result.ttft}
