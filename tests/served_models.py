"""The real server that tests/conftest.py's `served` starts once for the whole session.

It serves the embedded SmolLM2 (`smollm2-135m-instruct`) and, beside it, the default embedding
model (`all-minilm-l6-v2`); its context is cut to 256 tokens so over-long prompts are cheap.
KServe V2 over gRPC listens on `grpc` (host:port).

The tests compare the model's real answers ("Paris"); bf16's roundings flip some of them on a
model this small (its first token for the capital of France: "The" leads "L" by 0.08 in
float32, ties in bf16), and so does llama.cpp's arithmetic on the GGUF's 4-bit blocks (llama.cpp
itself answers "L'Étoile, la Cité, ..."). So where the torch engine serves, it serves float32
linears on every machine (`auto` picks bf16 where the CPU runs it faster, and the GGUF's blocks;
both have tests of their own: tests/protocols/test_load.py,
tests/engines/test_quantized_engine.py). The llama.cpp and vLLM lanes keep their engines' own
settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from handlers.config import load_config, parse_args
from handlers.engine import registry


@dataclass(frozen=True)
class Served:
    url: str
    context: int  # option.max_model_len
    grpc: str  # host:port of KServe V2 over gRPC
    log: Path  # the server's output
    pid: int  # the server's process


def float32_where_torch_serves() -> list[str]:
    """`option.dtype=fp32` and `option.quantize=none` where `auto` runs the torch engine here,
    else nothing (the other engines' lanes set their own)."""
    config = load_config(parse_args([]), env=dict(os.environ))
    torch_serves = registry.chosen(config).name == "torch"
    return ["option.dtype=fp32", "option.quantize=none"] if torch_serves else []
