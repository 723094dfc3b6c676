"""Stopping a real lmi-serve: a burst of SIGTERM and SIGINT (a double Ctrl-C, an orchestrator
that repeats itself) stops it once, with exit code 0, as one signal does, and so does a signal
that the kernel hands to a thread other than the main one; streams still running at the drain
limit end with their protocol's error event, and the exit is still 0."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from server_process import InvocationStream, free_port, server_process


@pytest.mark.parametrize("burst", [1, 300])
def test_signals_stop_the_server_once_however_many_arrive(tiny_dir, tmp_path, burst):
    log = tmp_path / "server.log"
    with server_process(f"option.model_id={tiny_dir}", "option.embedding_model_id=none",
                        log_path=log) as (proc, _url):
        for i in range(burst):
            proc.send_signal(signal.SIGINT if i % 3 == 2 else signal.SIGTERM)
        assert proc.wait(timeout=120) == 0  # a hang guard: it exits in a second or two
    assert log.read_text().count("finishing in-flight requests, then exiting") == 1


def test_a_signal_taken_by_another_thread_stops_an_idle_server(tiny_dir, tmp_path):
    # kill() naming a thread's id sends to the whole process but lets that thread take the
    # signal; the idle engine's main thread sleeps on its inbox meanwhile.
    log = tmp_path / "server.log"
    with server_process(f"option.model_id={tiny_dir}", "option.embedding_model_id=none",
                        log_path=log) as (proc, _url):
        thread = max(int(task) for task in os.listdir(f"/proc/{proc.pid}/task"))
        assert thread != proc.pid
        os.kill(thread, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0  # a hang guard: it exits in a second or two
    assert "received SIGTERM: finishing in-flight requests" in log.read_text()


def test_streams_past_the_drain_limit_end_with_their_error_and_the_server_exits_0(tiny_dir,
                                                                                   tmp_path):
    # Steps of at least 0.1 s (tests/fault_server.py's FAULT_SLOW): 400 tokens outlast the
    # 1 s drain limit however fast the machine is.
    log = tmp_path / "server.log"
    grpc_port = free_port()
    with server_process(f"option.model_id={tiny_dir}", "option.model_name=tiny",
                        "option.embedding_model_id=none", "timeout_graceful_shutdown=1",
                        log_path=log, grpc_port=grpc_port,
                        program=("tests/fault_server.py",)) as (proc, url):
        http = InvocationStream(url, {"inputs": "FAULT_SLOW once upon a time", "stream": True,
                                      "parameters": {"max_new_tokens": 400,
                                                     "min_new_tokens": 400}})
        grpc_stream = GrpcStream(f"127.0.0.1:{grpc_port}")
        threads = [threading.Thread(target=s.run) for s in (http, grpc_stream)]
        for thread in threads:
            thread.start()
        assert http.started.wait(120) and grpc_stream.started.wait(120)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0  # a hang guard
        for thread in threads:
            thread.join(60)
    assert http.error is None
    assert http.lines[-1]["token"]["id"] == -1
    assert http.lines[-1]["details"]["finish_reason"] == "error"
    assert len(http.lines) < 400
    assert "shutting down" in str(grpc_stream.error)
    said = log.read_text()
    assert "KServe V2 gRPC stopped" in said
    for trouble in ("never awaited", "Event loop is closed", "Traceback"):
        assert trouble not in said


@dataclasses.dataclass
class GrpcStream:
    """A long KServe V2 gRPC stream (tritonclient.grpc) on the tiny model; `error` is what
    ended it, if anything did."""

    address: str
    started: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: BaseException | None = None

    def run(self) -> None:
        ended = threading.Event()
        client = triton_grpc.InferenceServerClient(self.address)
        tensor = triton_grpc.InferInput("text_input", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([b"FAULT_SLOW far away"], dtype=np.object_))

        def on_response(result, error) -> None:
            if error is not None:
                self.error = error
                ended.set()
            self.started.set()

        client.start_stream(callback=on_response)
        client.async_stream_infer("tiny", [tensor], parameters={"max_new_tokens": 400,
                                                                "min_new_tokens": 400})
        ended.wait(120)
        client.stop_stream()
