"""One real server, shared by the test modules that declare `pytest_plugins = ["served_models"]`
(a plugin's session fixture starts once, unlike a fixture imported into each module).

It serves the embedded SmolLM2 (`smollm2-135m-instruct`) and, beside it, the default embedding
model (`all-minilm-l6-v2`); its context is cut to 256 tokens so over-long prompts are cheap.
KServe V2 over gRPC listens on `grpc` (host:port).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from server_process import free_port, running_server


@dataclass(frozen=True)
class Served:
    url: str
    context: int  # option.max_model_len
    grpc: str  # host:port of KServe V2 over gRPC
    log: Path  # the server's output


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    context = 256
    log = tmp_path_factory.mktemp("served") / "server.log"
    grpc_port = free_port()
    with running_server(f"option.max_model_len={context}", log_path=log,
                        grpc_port=grpc_port) as url:
        yield Served(url, context, f"127.0.0.1:{grpc_port}", log)
