"""Starting a server (ours or a peer) as a subprocess, waiting until it serves, and stopping it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

import httpx

REPO = Path(__file__).resolve().parents[1]  # `python -m handlers.cli` runs from here
EMBEDDER = "all-minilm-l6-v2"  # the embedding model our server loads beside the LLM

Command = Callable[[int], list[str]]  # the command line that serves on a given port


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def thread_env(threads: int) -> dict[str, str]:
    """This environment with torch's (OpenMP/MKL) thread pools limited to `threads`."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def lmi_serve(options: Sequence[str], python: str = sys.executable) -> Command:
    """`lmi-serve` (gRPC off) with these `option.X=Y` settings, run by `python`."""
    settings = [arg for option in options for arg in ("--option", option)]
    return lambda port: [python, "-m", "handlers.cli", "--host", "127.0.0.1",
                         "--port", str(port), "--grpc-port", "0", *settings]


class ServerProcess:
    """A server on a local port (a free one unless given), as a context manager; its output
    goes to `log_path`. `env` None: this process's environment."""

    def __init__(self, command: Command, log_path: Path, env: dict[str, str] | None = None,
                 port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = command(self.port)
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.launched = 0.0  # time.time() at the start

    def __enter__(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.launched = time.time()
            self.proc = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO
            )
        return self

    def until(self, check: Callable[[], bool], what: str, timeout: float, poll: float) -> float:
        """The time.time() at which `check()` first held (an HTTP error counts as not yet),
        polled every `poll` seconds; fails early, with the log's tail, if the server exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if check():
                    return time.time()
            except httpx.HTTPError:
                pass  # not listening yet, or busy
            time.sleep(poll)
        raise TimeoutError(f"no {what} after {timeout:.0f} s ({self.log_path}):\n"
                           f"{self.log_tail()}")

    def wait_ready(self, timeout: float, path: str = "/ping", poll: float = 0.5) -> float:
        """Seconds from the launch until `GET path` answers 200."""
        ok = self.until(lambda: httpx.get(self.url + path, timeout=5).status_code == 200,
                        f"{path} 200", timeout, poll)
        return ok - self.launched

    def wait_embeddings(self, timeout: float, poll: float = 1.0) -> float:
        """Seconds until the embedding model our server loads once it serves has answered (a
        request sent meanwhile waits for it)."""
        began = time.time()
        body = {"model": EMBEDDER, "input": "warm up"}
        ok = self.until(lambda: httpx.post(f"{self.url}/v1/embeddings", json=body,
                                           timeout=timeout).status_code == 200,
                        "embeddings answer", timeout, poll)
        return ok - began

    def wait_decode_graphs(self, timeout: float) -> float:
        """Seconds until our torch engine's compiled decode step is in use (its /metrics:
        lmi_decode_graphs_ready reaching lmi_decode_graphs_total), as vLLM's server compiles
        before it answers; about 0 for a server that compiles none."""
        from prometheus_client.parser import text_string_to_metric_families

        def compiled() -> bool:
            text = httpx.get(f"{self.url}/metrics", timeout=30).text
            found = {s.name: s.value for f in text_string_to_metric_families(text)
                     for s in f.samples if s.name.startswith("lmi_decode_graphs_")}
            return found.get("lmi_decode_graphs_ready") == found.get("lmi_decode_graphs_total")

        began = time.time()
        return self.until(compiled, "decode graphs in use", timeout, poll=2.0) - began

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
