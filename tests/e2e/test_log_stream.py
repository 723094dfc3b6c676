"""Where a real lmi-serve logs: every log line, its own and uvicorn's (startup, access, shutdown),
on stdout, as DJL Serving logs; stderr carries none (SageMaker ships both to CloudWatch, but
one stream keeps the lines in order)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx
from server_process import _wait_ready, free_port

LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ |[A-Z]+: +)")  # ours, uvicorn's


def test_every_log_line_goes_to_stdout(tiny_dir, tmp_path):
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    port = free_port()
    argv = [sys.executable, "-m", "handlers.cli", "--host", "127.0.0.1", "--port", str(port),
            "--grpc-port", "0", "--option", f"option.model_id={tiny_dir}", "--option",
            "option.embedding_model_id=none"]
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(proc, url, timeout=180)
            assert httpx.post(f"{url}/invocations", json={"inputs": "Hi", "parameters": {
                "max_new_tokens": 2}}, timeout=60).status_code == 200
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 0
    said = out.read_text()
    assert "model tiny-llama is ready" in said  # the server's own
    assert '"POST /invocations HTTP/1.1" 200' in said  # uvicorn's access line
    assert "Uvicorn running on" in said and "Finished server process" in said  # uvicorn's others
    assert not [line for line in err.read_text().splitlines() if LOG_LINE.match(line)]
