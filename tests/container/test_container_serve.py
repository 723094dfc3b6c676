"""`container/serve`, the image's entrypoint, started exactly as SageMaker starts it: the only
argument is `serve`, the port comes from SAGEMAKER_BIND_TO_PORT, and SIGTERM stops it.

One container process serves this module; the SIGTERM test ends it, so it runs last.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson
import pytest
import requests
import tritonclient.grpc as triton_grpc
from server_process import InvocationStream as Stream
from server_process import _wait_ready, free_port

REPO = Path(__file__).resolve().parents[2]
SERVE = REPO / "container" / "serve"
# Configuration a CI host's environment must not leak into the container under test.
FOREIGN_ENV = ("OPTION_", "SERVING_", "SAGEMAKER_", "HF_MODEL_", "SM_")

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(Path("/opt/ml/model").exists(),
                       reason="a host /opt/ml/model would be served instead of the default"),
]


@dataclass
class Container:
    proc: subprocess.Popen
    url: str


@pytest.fixture(scope="module")
def container(tmp_path_factory) -> Iterator[Container]:
    workdir = tmp_path_factory.mktemp("container")  # not the repository: serve must not need it
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN_ENV)}
    # The venv's `lmi-serve` on PATH, as the image's pip install puts it there.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["SAGEMAKER_BIND_TO_PORT"] = str(port)
    # Eager, as every test server (tests/conftest.py): a decode-graph compile beside it slowed
    # the drain past the test's 30 s on CI.
    env["OPTION_ENFORCE_EAGER"] = "true"
    with open(workdir / "serve.log", "wb") as log:
        proc = subprocess.Popen([str(SERVE), "serve"], cwd=workdir, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(proc, url, timeout=180)
            yield Container(proc, url)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def test_serve_answers_on_the_sagemaker_port(container):
    ping = requests.get(f"{container.url}/ping", timeout=5)
    assert ping.status_code == 200
    body = {"inputs": chat("Name three colors."), "parameters": {"max_new_tokens": 4}}
    response = requests.post(f"{container.url}/invocations", data=orjson.dumps(body), timeout=60)
    assert response.status_code == 200
    assert response.json()["generated_text"].strip()


@dataclass
class GrpcStream:
    """One KServe V2 gRPC stream (tritonclient.grpc): its responses' texts and final flags."""

    address: str
    prompt: str
    tokens: int
    started: threading.Event = field(default_factory=threading.Event)
    pieces: list[tuple[str, bool]] = field(default_factory=list)
    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def run(self) -> None:
        client = triton_grpc.InferenceServerClient(self.address)
        tensor = triton_grpc.InferInput("text_input", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([self.prompt.encode()], dtype=np.object_))
        client.start_stream(callback=self.on_response)
        client.async_stream_infer("smollm2-135m-instruct", [tensor], request_id="g",
                                  enable_empty_final_response=True, parameters={
                                      "max_new_tokens": self.tokens, "ignore_eos": True})
        self.finished.wait(60)
        client.stop_stream()

    def on_response(self, result, error) -> None:
        if error is not None:
            self.error = error
            self.finished.set()
            return
        final = result.get_response().parameters["triton_final_response"].bool_param
        self.pieces.append((result.as_numpy("text_output")[0].decode(), final))
        self.started.set()
        if final:
            self.finished.set()


def listener_closes(url: str) -> bool:
    """Whether /ping stops being answered (a refused connection) once SIGTERM was sent; polled,
    with a cap only against hanging."""
    for _ in range(600):
        try:
            requests.get(f"{url}/ping", timeout=5)
        except requests.ConnectionError:
            return True
        time.sleep(0.05)
    return False


def test_sigterm_lets_in_flight_streams_finish_then_exits_0(container):
    tokens = 32
    questions = ("Hi", "Why?", "Cats", "Rain", "Tea", "Maps", "Snow", "Jazz")
    streams = [Stream(container.url, {"inputs": chat(q), "stream": True, "parameters": {
        "max_new_tokens": tokens, "ignore_eos": True}}, read_timeout=60) for q in questions]
    grpc_stream = GrpcStream("127.0.0.1:8081", chat("Clouds"), tokens)  # the default gRPC port
    threads = [threading.Thread(target=s.run) for s in [*streams, grpc_stream]]
    for thread in threads:
        thread.start()
    assert all(s.started.wait(60) for s in [*streams, grpc_stream])
    assert not any("generated_text" in s.lines[-1] for s in streams if s.lines), "not in flight"
    assert not grpc_stream.finished.is_set(), "not in flight"

    container.proc.send_signal(signal.SIGTERM)
    assert listener_closes(container.url)  # uvicorn stops taking connections while it drains
    assert container.proc.wait(timeout=30) == 0
    for thread in threads:
        thread.join(timeout=5)
    assert [s.error for s in [*streams, grpc_stream]] == [None] * (len(streams) + 1)
    for stream in streams:
        assert len(stream.lines) == tokens
        assert stream.lines[-1]["generated_text"]
    assert len(grpc_stream.pieces) == tokens and grpc_stream.pieces[-1][1]
