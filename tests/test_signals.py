"""Stopping a real lmi-serve: a burst of SIGTERM and SIGINT (a double Ctrl-C, an orchestrator
that repeats itself) stops it once, with exit code 0, as one signal does."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from server_process import server_process
from tiny_model import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("burst", [1, 300])
def test_signals_stop_the_server_once_however_many_arrive(tiny_dir, tmp_path, burst):
    log = tmp_path / "server.log"
    with server_process(f"option.model_id={tiny_dir}", "option.embedding_model_id=none",
                        log_path=log) as (proc, _url):
        for i in range(burst):
            proc.send_signal(signal.SIGINT if i % 3 == 2 else signal.SIGTERM)
        assert proc.wait(timeout=120) == 0  # a hang guard: it exits in a second or two
    assert log.read_text().count("finishing in-flight requests, then exiting") == 1
