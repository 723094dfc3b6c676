"""Stopping a real lmi-serve: a burst of SIGTERM and SIGINT (a double Ctrl-C, an orchestrator
that repeats itself) stops it once, with exit code 0, as one signal does, and so does a signal
that the kernel hands to a thread other than the main one."""

from __future__ import annotations

import os
import signal

import pytest
from server_process import server_process


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
