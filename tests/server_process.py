"""Run `lmi-serve` as a real subprocess on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import requests
import uvicorn


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(*options: str, log_path: Path | None = None,
                   env: dict[str, str | None] | None = None, timeout: float = 180,
                   grpc_port: int = 0, program: tuple[str, ...] = ("-m", "handlers.cli"),
                   model_dir: Path | None = None) -> Iterator[str]:
    """Start the server with `--option KEY=VALUE` flags (and gRPC on `grpc_port`, 0: off;
    `--model-dir` where given); yield its URL once /ping says 200."""
    with server_process(*options, log_path=log_path, env=env, timeout=timeout,
                        grpc_port=grpc_port, program=program, model_dir=model_dir) as (_proc,
                                                                                       url):
        yield url


@contextlib.contextmanager
def server_process(*options: str, log_path: Path | None = None,
                   env: dict[str, str | None] | None = None, timeout: float = 180,
                   grpc_port: int = 0, program: tuple[str, ...] = ("-m", "handlers.cli"),
                   model_dir: Path | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """As `running_server`, yielding the process too (`program`: what python runs, the
    lmi-serve module or a script that wraps it); SIGTERM at the end if it still runs. `env`
    adds to this process's environment; a None value removes that variable."""
    port = free_port()
    argv = [sys.executable, *program, "--host", "127.0.0.1", "--port", str(port),
            "--grpc-port", str(grpc_port)]
    if model_dir is not None:
        argv += ["--model-dir", str(model_dir)]
    for option in options:
        argv += ["--option", option]
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
    merged = {**os.environ, **(env or {})}  # a None in `env` removes the variable
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            env={k: v for k, v in merged.items() if v is not None})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, timeout)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log_path:
            log.close()


def _wait_ready(proc: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} while starting")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/ping", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"the server at {url} was not ready within {timeout} s")


@contextlib.contextmanager
def serving(app: object) -> Iterator[str]:
    """Serve an ASGI app (e.g. over the FakeEngine) with uvicorn in a thread; yield its URL."""
    server = uvicorn.Server(uvicorn.Config(app, "127.0.0.1", 0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(5)


@contextlib.asynccontextmanager
async def serving_here(app: object) -> AsyncIterator[str]:
    """As `serving`, on the caller's event loop (so a test can watch the app's engine while a
    client talks to it); yield its URL."""
    server = uvicorn.Server(uvicorn.Config(app, "127.0.0.1", 0, log_level="warning",
                                           lifespan="off", timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


@dataclass
class InvocationStream:
    """One streaming /invocations request (jsonlines) in a thread; `started` is set once its
    first line arrives, or once it failed."""

    url: str
    body: dict
    read_timeout: float = 120
    started: threading.Event = field(default_factory=threading.Event)
    lines: list[dict] = field(default_factory=list)
    error: BaseException | None = None

    def run(self) -> None:
        try:
            with requests.post(f"{self.url}/invocations", data=orjson.dumps(self.body),
                               stream=True, timeout=(5, self.read_timeout)) as response:
                for line in response.iter_lines():
                    if line:
                        self.lines.append(orjson.loads(line))
                        self.started.set()
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.error = exc
            self.started.set()
