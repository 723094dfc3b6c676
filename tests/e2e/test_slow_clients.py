"""Slow, idle and malformed clients against a real lmi-serve, over raw sockets: a request head
that never completes and a body that stops arriving are closed by the server (408), idle
connections go, connections past the cap are refused, a body framed two ways is refused (400),
and a client that leaves mid-body costs one log line."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import orjson
import pytest
from server_process import running_server

HANG_GUARD = 60.0  # seconds: the server's timeouts here are 1 s; this only bounds a failure


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    log = tmp_path_factory.mktemp("slow") / "server.log"
    with running_server(f"option.model_id={tiny_dir}", "option.embedding_model_id=none",
                        "client_header_timeout=1", "client_body_timeout=1",
                        log_path=log) as url:
        yield url, log


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=HANG_GUARD)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def status_and_body(answer: bytes) -> tuple[int, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def head(path: str, **headers: str | int) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", *(f"{k.replace('_', '-')}: {v}"
                                                      for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_a_request_head_that_stops_arriving_is_answered_408_and_closed(server):
    url, _log = server
    with connect(url) as sock:
        sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: test\r\nContent-Ty")
        answer = read_until_closed(sock)
    assert status_and_body(answer)[0] == 408


def test_a_slowloris_head_is_closed_however_it_trickles(server):
    url, _log = server
    with connect(url) as sock:
        sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: test\r\n")
        sock.settimeout(0.2)
        closed = False
        deadline = time.monotonic() + HANG_GUARD
        while not closed and time.monotonic() < deadline:
            try:
                sock.sendall(b"X-a: b\r\n")  # a header line every 0.2 s, never the blank line
                closed = sock.recv(65536) == b""
            except TimeoutError:
                continue
            except OSError:  # reset or broken pipe: the server closed it
                closed = True
            else:
                closed = True  # the 408, then the close
    assert closed


def test_an_idle_connection_is_closed(server):
    url, _log = server
    with connect(url) as sock:
        assert read_until_closed(sock) == b""  # nothing sent, nothing answered: just closed


@pytest.mark.parametrize(("path", "error"), [
    ("/invocations", lambda body: body["code"] == 408 and "client_body_timeout" in body["error"]),
    ("/v1/chat/completions",
     lambda body: "client_body_timeout" in body["error"]["message"]),
])
def test_a_body_shorter_than_its_length_is_answered_408_in_the_protocols_shape(server, path,
                                                                              error):
    url, _log = server
    with connect(url) as sock:
        sock.sendall(head(path, content_type="application/json", content_length=100)
                     + b'{"inputs": "')
        answer = read_until_closed(sock)  # the server closes it after the 408
    status, body = status_and_body(answer)
    assert status == 408
    assert b"connection: close" in answer.lower()
    assert error(orjson.loads(body))


def test_content_length_with_transfer_encoding_is_refused(server):
    url, _log = server
    body = b'{"inputs": "hi"}'
    with connect(url) as sock:
        sock.sendall(head("/invocations", content_type="application/json",
                          content_length=len(body), transfer_encoding="chunked")
                     + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        answer = read_until_closed(sock)
    status, text = status_and_body(answer)
    assert status == 400
    assert b"Transfer-Encoding" in text


def test_a_client_leaving_mid_body_is_one_log_line(server):
    url, log = server
    with connect(url) as sock:
        sock.sendall(head("/v1/completions", content_type="application/json",
                          content_length=1000, x_request_id="leaves-mid-body")
                     + b'{"prompt": "')
    said = ""
    deadline = time.monotonic() + HANG_GUARD
    while time.monotonic() < deadline and not any(
            mark in said for mark in ("client disconnected", "Exception in ASGI")):
        time.sleep(0.1)
        said = "\n".join(line for line in log.read_text().splitlines()
                         if "leaves-mid-body" in line or "Exception in ASGI" in line)
    assert said.count("client disconnected while sending the request body") == 1
    assert "Exception in ASGI" not in said
    assert "Traceback" not in log.read_text()


@pytest.mark.parametrize(("options", "cap"), [(("max_connections=3",), 3),
                                              (("job_queue_size=2",), 4)])  # unset: 2x queue
def test_connections_past_the_cap_are_refused(tiny_dir, options, cap):
    with running_server(f"option.model_id={tiny_dir}", "option.embedding_model_id=none",
                        *options) as url:
        held = [connect(url) for _ in range(cap)]
        try:
            with connect(url) as extra:
                answer = read_until_closed(extra)
            assert status_and_body(answer)[0] == 503
            assert b"retry-after: 1" in answer.lower()
            held.pop().close()
            assert served_once_a_connection_left(url)
        finally:
            for sock in held:
                sock.close()


def served_once_a_connection_left(url: str) -> bool:
    """A new connection is served once the server saw one of the held ones close (retried
    while the close is on its way)."""
    deadline = time.monotonic() + HANG_GUARD
    while time.monotonic() < deadline:
        with connect(url) as sock:
            sock.sendall(b"GET /ping HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
            if status_and_body(read_until_closed(sock))[0] == 200:
                return True
        time.sleep(0.1)
    return False
