"""Nothing leaks: 1,000 requests to a real server over the torch engine (the tiny model), a third
run to their end, a third aborted by clients that go away mid-stream, a third past their deadline
(Triton's `timeout`), leave no batch slot, cached sequence, server task, thread or file
descriptor behind."""

from __future__ import annotations

import asyncio
import gc
from urllib.parse import urlsplit

import httpx
import psutil
from server_process import serving

from handlers.engine.torch.engine import TorchEngine
from handlers.server.app import create_app
from handlers.server.context import Served, ServerContext, ServerSettings

REQUESTS = 1000
CONCURRENCY = 16
LONG = {"max_new_tokens": 400, "min_new_tokens": 400}


async def complete(http: httpx.AsyncClient) -> str:
    body = {"inputs": "hello there", "parameters": {"max_new_tokens": 4}}
    response = await http.post("/invocations", json=body)
    return "done" if response.status_code == 200 else f"done: {response.status_code}"


async def abandon(http: httpx.AsyncClient) -> str:
    body = {"inputs": "tell me a story", "parameters": LONG, "stream": True}
    async with http.stream("POST", "/invocations", json=body) as response:
        async for _line in response.aiter_lines():
            return "aborted"  # the first token came: go away
    return "aborted: no token"


async def time_out(http: httpx.AsyncClient) -> str:
    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                        "data": ["a long answer"]}],
            "parameters": {**LONG, "timeout": 1000}}  # microseconds: far less than 400 tokens
    response = await http.post("/v2/models/tiny/infer", json=body)
    return "timed out" if "deadline" in response.text else f"timed out: {response.status_code}"


async def run_all(url: str, count: int = REQUESTS) -> list[str]:
    kinds = [complete, abandon, time_out]
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> str:
        async with gate, httpx.AsyncClient(base_url=url, timeout=120) as http:
            return await kinds[i % 3](http)

    return await asyncio.gather(*(one(i) for i in range(count)))


async def server_tasks(ctx: ServerContext) -> int:
    async def count() -> int:
        return len(asyncio.all_tasks())

    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(count(), ctx.loop))


async def settled(engine: TorchEngine) -> None:
    """Aborts reach the engine loop after the client's answer: wait for them by count."""
    while engine.batcher.has_work or engine.batcher.states:
        await asyncio.sleep(0.05)


async def quiet(process: psutil.Process, url: str) -> None:
    """The server closes a connection's socket some time after its client went: wait, by count,
    until no connection to or from the server's port is open (client and server share this
    process), so that open files are counted in the same state before and after."""
    port = urlsplit(url).port

    def open_connections() -> int:
        return sum(1 for c in process.net_connections(kind="tcp")
                   if c.status != psutil.CONN_LISTEN
                   and port in (c.laddr.port, c.raddr.port if c.raddr else None))

    while open_connections():
        await asyncio.sleep(0.05)


async def test_a_thousand_requests_a_third_aborted_and_a_third_timed_out_leak_nothing(loaded):
    engine = TorchEngine(loaded, max_batch_size=8)
    await engine.start()
    ctx = ServerContext(ServerSettings("tiny"), Served("tiny", engine))
    process = psutil.Process()
    try:
        with serving(create_app(ctx)) as url:
            await run_all(url, 99)  # first: lazily made pools and caches settle
            await asyncio.wait_for(settled(engine), 120)
            await asyncio.wait_for(quiet(process, url), 60)
            gc.collect()  # files of earlier tests' garbage close now, not between the counts
            before = (process.num_fds(), process.num_threads(), await server_tasks(ctx))
            outcomes = await run_all(url)
            await asyncio.wait_for(settled(engine), 120)
            await asyncio.wait_for(quiet(process, url), 60)
            gc.collect()
            after = (process.num_fds(), process.num_threads(), await server_tasks(ctx))
    finally:
        await engine.shutdown()
    assert sorted(set(outcomes)) == ["aborted", "done", "timed out"]
    assert ctx.admission.held == 0
    batcher = engine.batcher
    assert not batcher.waiting and not batcher.prefilling and not batcher.decoding
    assert batcher.stats()["kv_cache_slots_in_use"] == 0
    assert batcher.runner.cache.capacity == batcher.runner.cache.initial_len  # grown, given back
    # Files and server tasks come back to their count; threads may be fewer (anyio ends a
    # worker thread idle for 10 s, which a slow machine's second run gives it), never more.
    assert (after[0], after[2]) == (before[0], before[2]) and after[1] <= before[1]
