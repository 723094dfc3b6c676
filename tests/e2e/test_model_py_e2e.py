"""A model.py beside serving.properties, served by the real `lmi-serve` on the tiny model: with
DJL's djl_python, and without it (its import blocked, as in the image and `./dev serve`), the
same file loads and gives the same answers; an import error stops startup naming the file and
its line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from model_py_files import FORMATTERS, write
from optional_deps import required
from server_process import free_port, running_server

# lmi-serve in a process where `import djl_python` fails.
WITHOUT_DJL_PYTHON = ("-c", "import sys; sys.modules['djl_python'] = None; "
                      "from handlers.cli import main; main()")
QUESTION = {"question": "Once upon a time", "length": 5}
# Asked at collection, before a test of this session could register the stand-in.
DJL_PYTHON_INSTALLED = importlib.util.find_spec("djl_python") is not None


def model_dir(root: Path, tiny_dir: Path, text: str) -> Path:
    folder = write(root, text)
    (folder / "serving.properties").write_text(
        f"option.model_id={tiny_dir}\noption.embedding_model_id=none\n")
    return folder


def served(folder: Path, log: Path, program: tuple[str, ...]) -> tuple[dict, list[dict], str]:
    """The formatted answer to QUESTION, the formatted stream of it, and the server's log."""
    with running_server(model_dir=folder, log_path=log, program=program) as url:
        whole = httpx.post(f"{url}/invocations", json=QUESTION, timeout=120)
        streamed = httpx.post(f"{url}/invocations", json={**QUESTION, "stream": True},
                              timeout=120)
    assert whole.status_code == streamed.status_code == 200, (whole.text, streamed.text)
    lines = [json.loads(line) for line in streamed.text.splitlines() if line]
    return whole.json(), lines, log.read_text()


@pytest.mark.e2e
def test_a_model_py_serves_with_and_without_djl_python(tmp_path, tiny_dir):
    folder = model_dir(tmp_path / "model", tiny_dir, FORMATTERS)
    alone = served(folder, tmp_path / "without.log", WITHOUT_DJL_PYTHON)
    answer, lines, log = alone
    assert "decorators from lmi-serve's stand-in for djl_python" in log
    assert set(answer) == {"answer", "finish_reason", "model"} and answer["model"] == "tiny-llama"
    assert answer["finish_reason"] == "length"
    assert [list(line) for line in lines] == [["token"]] * 5 + [["generated_tokens"], ["done"]]
    assert "".join(line["token"] for line in lines[:5]) == answer["answer"]  # greedy, both
    if not DJL_PYTHON_INSTALLED and "djl_python" not in required():
        pytest.skip("the run with DJL's djl_python needs it installed (../shared/vendor)")
    answer_djl, lines_djl, log_djl = served(folder, tmp_path / "with.log", ("-m", "handlers.cli"))
    assert "decorators from DJL's djl_python 0.36.0" in log_djl
    assert (answer_djl, lines_djl) == (answer, lines)


@pytest.mark.e2e
def test_a_model_py_that_fails_to_import_stops_startup_naming_its_line(tmp_path, tiny_dir):
    folder = model_dir(tmp_path / "model", tiny_dir,
                       "from djl_python.input_parser import input_formatter\n\n"
                       "import no_such_module\n")
    argv = [sys.executable, *WITHOUT_DJL_PYTHON, "--port", str(free_port()), "--grpc-port",
            "0", "--model-dir", str(folder)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert (f"importing {folder / 'model.py'}, line 3 failed: ModuleNotFoundError: No module "
            "named 'no_such_module'; stopping") in done.stdout
    assert "projection groups fused" not in done.stdout  # before the model loaded
