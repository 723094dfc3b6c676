"""Fixtures every folder of tests shares: the tiny model, and the real server on the embedded
models (tests/protocols/conftest.py adds the FakeEngine's server).

Servers and engines built in tests decode eagerly unless a test asks for the compiled step:
compiling it takes minutes (tests/engines/test_decode_graphs.py compiles the tiny model's and
checks it against the eager step)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from served_models import Served, float32_where_torch_serves
from server_process import free_port, server_process
from tiny_model import make_tiny_model_dir

from handlers.engine.torch.loader import LoadedModel, load_model

# Read when a server or an engine is configured, never at import.
os.environ.setdefault("OPTION_ENFORCE_EAGER", "true")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Llama's directory (tests/tiny_model.py), `tiny-llama`: one per
    module, so a module may add files to it."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def loaded(tiny_dir: Path) -> LoadedModel:
    """The tiny model loaded in float32, for the torch engines a module builds."""
    return load_model(tiny_dir, dtype="fp32")


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One real server for the whole session (tests/served_models.py says what it serves)."""
    context = 256
    log = tmp_path_factory.mktemp("served") / "server.log"
    grpc_port = free_port()
    with server_process(f"option.max_model_len={context}", *float32_where_torch_serves(),
                        log_path=log, grpc_port=grpc_port) as (proc, url):
        yield Served(url, context, f"127.0.0.1:{grpc_port}", log, proc.pid)
