"""Starting our server as a subprocess, waiting until it serves, and stopping it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

REPO = Path(__file__).resolve().parents[1]  # `python -m handlers.cli` runs from here


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def thread_env(threads: int) -> dict[str, str]:
    """This environment with torch's (OpenMP/MKL) thread pools limited to `threads`."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


class ServerProcess:
    """`lmi-serve` on a free local port, as a context manager; its output goes to `log_path`."""

    def __init__(self, log_path: Path, max_batch: int, threads: int, dtype: str = "auto") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.command = [
            sys.executable, "-m", "handlers.cli",
            "--host", "127.0.0.1", "--port", str(self.port), "--grpc-port", "0",
            "--option", f"option.max_rolling_batch_size={max_batch}",
            "--option", f"option.dtype={dtype}",
        ]
        self.env = thread_env(threads)
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO
            )
        return self

    def wait_ready(self, timeout: float) -> None:
        """Poll `GET /ping` until 200; fail early, with the log's tail, if the server exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/ping", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout:.0f} s:\n{self.log_tail()}")

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
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
