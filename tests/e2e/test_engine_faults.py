"""Engine supervision, end to end: faults injected into the torch engine of a real lmi-serve
(tests/fault_server.py) end the requests they touch with the protocol's error, readiness tells
the truth, and the server recovers (option.engine_restart) or exits non-zero."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import server_process

FAULT_SERVER = ("tests/fault_server.py",)
LONG = {"max_new_tokens": 300, "min_new_tokens": 300, "details": True}  # runs past the fault


@contextlib.contextmanager
def faulty_server(tiny_dir: Path, tmp_path: Path, *options: str,
                  env: dict[str, str] | None = None):
    with server_process(f"option.model_id={tiny_dir}", "option.embedding_model_id=none",
                        *options, log_path=tmp_path / "server.log", env=env,
                        program=FAULT_SERVER) as (proc, url):
        yield proc, url


def invoke(url: str, prompt: str, **parameters) -> httpx.Response:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 8, **parameters}}
    return httpx.post(f"{url}/invocations", json=body, timeout=120)


class Stream:
    """A streaming /invocations request read in a thread: `started` is set at its first line."""

    def __init__(self, url: str, prompt: str, parameters: dict | None = None) -> None:
        self.lines: list[dict] = []
        self.started = threading.Event()
        body = {"inputs": prompt, "parameters": parameters or LONG, "stream": True}
        self.thread = threading.Thread(target=self._read, args=(url, body))
        self.thread.start()

    def _read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", f"{url}/invocations", json=body, timeout=120) as response:
            for line in response.iter_lines():
                self.lines.append(orjson.loads(line))
                self.started.set()
        self.started.set()

    def result(self) -> list[dict]:
        self.thread.join(120)
        return self.lines


def ping(url: str) -> int:
    return httpx.get(f"{url}/ping", timeout=30).status_code


def wait_healthy(url: str) -> None:
    """Readiness comes back once the engine restarted (polled: a restart takes what it takes)."""
    for _ in range(600):
        if ping(url) == 200:
            return
        threading.Event().wait(0.1)
    raise AssertionError("the server did not become ready again")


def restarts(url: str) -> float:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text)
    return next(sample.value for family in families for sample in family.samples
                if sample.name == "lmi_engine_restarts_total")


def ended_with_error(lines: list[dict]) -> bool:
    return bool(lines) and lines[-1]["details"]["finish_reason"] == "error"


def test_a_failure_inside_one_request_fails_that_request_alone(tiny_dir, tmp_path):
    with faulty_server(tiny_dir, tmp_path) as (_proc, url):
        others = [Stream(url, f"hello {i}") for i in range(3)]
        for stream in others:
            stream.started.wait(120)
        failed = invoke(url, "FAULT_REQUEST please")
        assert failed.status_code == 424
        assert "injected fault in one request" in failed.json()["error"]
        for stream in others:
            lines = stream.result()
            assert lines[-1]["details"]["finish_reason"] == "length"
            assert lines[-1]["details"]["generated_tokens"] == 300
        assert ping(url) == 200 and restarts(url) == 0


def test_a_failed_step_ends_its_requests_and_the_engine_restarts(tiny_dir, tmp_path):
    with faulty_server(tiny_dir, tmp_path) as (proc, url):
        running = Stream(url, "hello there")
        running.started.wait(120)
        failed = invoke(url, "FAULT_STEP please")
        assert failed.status_code >= 400 and "injected fault" in failed.json()["error"]
        assert ended_with_error(running.result())
        wait_healthy(url)
        answer = invoke(url, "hello again")
        assert answer.status_code == 200 and answer.json()["generated_text"]
        assert proc.poll() is None and restarts(url) == 1


def test_a_failed_abort_ends_the_running_requests_and_the_engine_restarts(tiny_dir, tmp_path):
    with faulty_server(tiny_dir, tmp_path) as (_proc, url):
        running = Stream(url, "hello there")
        running.started.wait(120)
        body = {"inputs": "FAULT_ABORT please", "parameters": LONG, "stream": True}
        with httpx.stream("POST", f"{url}/invocations", json=body, timeout=120) as response:
            next(response.iter_lines())  # one token, then the client goes away: an abort
        assert ended_with_error(running.result())
        wait_healthy(url)
        assert invoke(url, "hello again").status_code == 200 and restarts(url) == 1


def test_without_engine_restart_a_failed_engine_exits_non_zero(tiny_dir, tmp_path):
    with faulty_server(tiny_dir, tmp_path, "option.engine_restart=false") as (proc, url):
        failed = invoke(url, "FAULT_STEP please")
        assert failed.status_code >= 400 and "injected fault" in failed.json()["error"]
        assert proc.wait(60) == 1


def test_a_stalled_step_fails_its_requests_and_exits_non_zero(tiny_dir, tmp_path):
    with faulty_server(tiny_dir, tmp_path, "option.engine_stall_timeout=1") as (proc, url):
        failed = invoke(url, "FAULT_STALL please")
        assert failed.status_code >= 400
        assert "engine is stuck" in failed.json()["error"]
        assert proc.wait(60) == 1
    assert "ran past option.engine_stall_timeout" in (tmp_path / "server.log").read_text()


def test_consecutive_failed_requests_turn_readiness_off(tiny_dir, tmp_path):
    options = ("option.max_consecutive_failures=3", "option.engine_restart=false")
    with faulty_server(tiny_dir, tmp_path, *options) as (proc, url):
        for _ in range(2):
            assert invoke(url, "FAULT_REQUEST please").status_code == 424
            assert ping(url) == 200
        assert invoke(url, "FAULT_REQUEST please").status_code == 424
        assert proc.wait(60) == 1
    assert "3 requests in a row failed" in (tmp_path / "server.log").read_text()


def test_consecutive_failed_requests_restart_the_engine(tiny_dir, tmp_path):
    with faulty_server(tiny_dir, tmp_path, "option.max_consecutive_failures=2") as (proc, url):
        for _ in range(2):
            assert invoke(url, "FAULT_REQUEST please").status_code == 424
        wait_healthy(url)
        assert restarts(url) == 1 and invoke(url, "hello").status_code == 200


def test_a_start_whose_engine_import_raises_exits_1_never_ready(tiny_dir, tmp_path):
    """The process ends (exit 1, the cause logged) instead of answering /ping 503 forever."""
    with pytest.raises(RuntimeError, match="exited with code 1 while starting"), \
            faulty_server(tiny_dir, tmp_path, env={"LMI_FAULT_ENGINE_IMPORT": "1"}):
        pass  # server_process polls /ping until the process exits: it never said 200
    log = (tmp_path / "server.log").read_text()
    assert "importing the engine failed" in log
    assert "operator torchvision::nms does not exist" in log


PROMPT_FOR_120 = "Write a long story about a dragon."
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}


def test_what_one_client_sends_never_trips_the_breaker_or_fails_another(tiny_dir, tmp_path):
    """Twelve requests the engine cannot run, on three routes, against a breaker of 3: each is
    refused naming its field, while a 120-token request in flight runs to its end, readiness
    stays on and the engine never restarts."""
    with faulty_server(tiny_dir, tmp_path, "option.max_consecutive_failures=3") as (_, url):
        running = Stream(url, PROMPT_FOR_120, {"max_new_tokens": 120, "min_new_tokens": 120,
                                               "details": True})
        running.started.wait(120)
        for _ in range(12):
            lmi = invoke(url, "Say hi", max_new_tokens=4, repetition_penalty=1e308)
            assert lmi.status_code == 424 and "repetition_penalty" in lmi.json()["error"]
            generate = httpx.post(f"{url}/v2/models/{tiny_dir.name}/generate", timeout=120,
                                  json={"text_input": "Say hi", "parameters": {
                                      "max_new_tokens": 4, "repetition_penalty": 1e308}})
            assert generate.status_code == 400 and "repetition_penalty" in generate.text
            chat = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "response_format": BAD_SCHEMA})
            assert chat.status_code == 400 and "response_format" in chat.text
            assert ping(url) == 200
        lines = running.result()
        assert lines[-1]["details"]["finish_reason"] == "length"
        assert lines[-1]["details"]["generated_tokens"] == 120
        assert ping(url) == 200 and restarts(url) == 0
